"""A model's remote code: the Python files transformers loads with `trust_remote_code=True`.

A model whose classes are not part of transformers (BailingMoeV3) names them in the `auto_map`
of its config.json (and tokenizer or processor configs), as `module.Class` (a file `module.py`
beside the config) or `org/repo--module.Class` (code in another repository, which transformers
fetches from there). transformers then also loads every module those files import relatively
(`from .x import y`, `import .x`), recursively. mconv carries exactly these files from its input
to its outputs and fetches them from the hub, so that the output loads as the input did; it
never imports or runs them (nothing in a checkpoint executes). This module imports nothing
heavy: it runs in commands that must not import transformers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# transformers.dynamic_module_utils.get_relative_imports' patterns, verbatim (tests/test_remote_code.py
# checks the files found here against transformers' own get_relative_import_files).
_RELATIVE_IMPORTS = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                     re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))


def auto_map_modules(directory: Path, config_names: tuple[str, ...]) -> list[str]:
    """The module files (`module.py`) that the `auto_map` of each JSON config in `config_names`
    found in `directory` names as local code, sorted; references into another repository (`--`)
    are left out. A config that is not valid JSON is skipped here (its reader reports it)."""
    modules = set()
    for name in config_names:
        path = Path(directory) / name
        if not name.endswith(".json") or not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, AttributeError, UnicodeDecodeError):
            continue
        # tokenizer configs of older transformers keep a bare list of classes
        references = auto_map.values() if isinstance(auto_map, dict) else auto_map or []
        for reference in references:
            for item in reference if isinstance(reference, (list, tuple)) else [reference]:
                module = item.rsplit(".", 1)[0] if isinstance(item, str) and "--" not in item else ""
                if module.isidentifier():  # a file beside the config, never a path out of it
                    modules.add(module + ".py")
    return sorted(modules)


def relative_imports(module: Path) -> list[str]:
    """The module files `module` imports relatively (`from .x import y` -> `x.py`), as transformers
    reads them: by pattern, without running the code. Empty if the file cannot be read or is no
    regular file (a FIFO would block the read; the copy then refuses it by name)."""
    if not module.is_file():
        return []
    try:
        text = module.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    return sorted({f"{name}.py" for pattern in _RELATIVE_IMPORTS for name in pattern.findall(text)
                   if name.isidentifier()})


def remote_code_files(directory: Path, config_names: tuple[str, ...]) -> list[str]:
    """Every file of `directory` that transformers needs for the remote code its configs name:
    the `auto_map` modules and, recursively, their relative imports; sorted names. Files named
    but absent are listed too (a hub download fetches them; a copy skips them)."""
    directory = Path(directory)
    found: list[str] = []
    pending = auto_map_modules(directory, config_names)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.append(name)
        pending += relative_imports(directory / name)
    return sorted(found)
