"""JSON over HTTP to an inference server's control routes (SGLang's weight-update routes, vLLM's
weight-transfer routes): the standard library's urllib, a bearer token where the server wants one."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request


def call_json(base: str, route: str, payload: dict | None, *, timeout: float, api_key: str | None = None,
              server: str = "the server") -> dict:
    """POST `payload` as JSON to `base`/`route` (GET where `payload` is None), with `api_key` as a
    bearer token where given. Returns the JSON reply, or {} for a reply that is not JSON. A refusal
    (an HTTP error status with a JSON body) comes back as that body with "success": False and
    "message" set to its `message`, `error` (or the error's own `message`) or `detail`; anything else
    is a RuntimeError naming
    `server` (e.g. "SGLang at http://...") and the route."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    request = urllib.request.Request(f"{base}/{route}", headers=headers,
                                     **({"method": "GET"} if payload is None else
                                        {"data": json.dumps(payload).encode(), "method": "POST"}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            reply = json.loads(body)
            message = next((reply[k] for k in ("message", "error", "detail") if reply.get(k)), body.decode())
            if isinstance(message, dict):  # vLLM's {"error": {"message": ..., "type": ...}}
                message = message.get("message", json.dumps(message))
            return dict(reply, success=False, message=message)
        except (ValueError, TypeError, AttributeError):
            raise RuntimeError(f"{server} answered {route.split('?')[0]} with HTTP {e.code}: "
                               f"{body[:200].decode(errors='replace').strip()}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise RuntimeError(f"{server} did not answer {route.split('?')[0]}: {e}") from None
    try:
        return json.loads(body)
    except ValueError:
        return {}
