"""Hugging Face Hub model names (`Qwen/Qwen3-8B`) wherever mconv takes an HF model directory.

A name is resolved the way transformers' `from_pretrained` resolves it, through huggingface_hub:
an existing local directory always wins; otherwise the name is a hub repository id and
`huggingface_hub.snapshot_download` returns its snapshot in the hub cache (`HF_HUB_CACHE`,
by default `$HF_HOME/hub`, laid out as `models--ORG--NAME/{blobs,refs,snapshots/COMMIT}`),
downloading what is missing unless `HF_HUB_OFFLINE=1`, with huggingface_hub's own progress bars
and token. Only the files mconv reads or carries are fetched: safetensors weights and their index
(when weights are needed; `pytorch_model*.bin` pickles only where a repository has no safetensors,
as transformers falls back to them), JSON configs, tokenizer files, and the remote code (`*.py`) the
configs' `auto_map` names (see remote_code).
"""
from __future__ import annotations

from pathlib import Path

from mconv.converter.options import check_path, option
from mconv.converter.remote_code import remote_code_files
from mconv.errors import MconvError

# What transformers reads of a model besides its weights: configs, tokenizer, chat template.
CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "merges.txt", "*.tiktoken"]
WEIGHT_PATTERNS = ["*.safetensors"]
BIN_PATTERNS = ["pytorch_model*.bin"]  # read by hf_bin


def _remote_code(folder: Path) -> list[str]:
    """The remote-code files the snapshot's JSON configs name (remote_code.remote_code_files)."""
    return remote_code_files(folder, tuple(p.name for p in folder.glob("*.json")))


def is_local(name_or_path: str | Path) -> bool:
    """Whether a model argument names a local directory (which always wins over a hub name)."""
    return Path(str(name_or_path)).expanduser().is_dir()


def check_revision(revision: str | None, *names: str | Path | None) -> None:
    """A revision must apply to something: MconvError if one is given but none of the model
    arguments `names` (None: not given) is a hub name (transformers ignores it silently there)."""
    given = [name for name in names if name]
    if revision and all(is_local(name) for name in given):
        what = " and ".join(map(str, given)) + (" is a local directory" if len(given) == 1 else " are local directories")
        raise MconvError(f"{what}; a revision applies only to hub model names" if given else
                         "a revision applies only to hub model names, and no hub name was given")


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text


def resolve_model(name_or_path: str | Path, revision: str | None = None, weights: bool = True,
                  progress: bool = True, parameter: str | None = None) -> Path:
    """The local directory of an HF model given as a directory or as a hub name.

    `name_or_path`: an existing directory (returned as is; MconvError with a `revision`), or a hub
    repository id such as `Qwen/Qwen3-8B`, resolved with `huggingface_hub.snapshot_download` at
    `revision` (branch, tag or commit; default the repository's default branch). `weights=False`
    fetches only configs and tokenizer files (e.g. for `--hf-config`). Returns the snapshot
    directory inside the hub cache. Raises MconvError (one sentence naming the cache) when the
    name is not a directory and cannot be found in the cache or on the Hub; a missing local path is
    named as the option `parameter` (e.g. "hf_config": `--hf-config /x`) where given.
    """
    check_path(name_or_path, parameter or "the HF model (a directory or hub name)")
    text = str(name_or_path)
    path = Path(text).expanduser()
    check_revision(revision, text)
    if path.is_dir():
        return path
    if path.exists() or _looks_like_path(text):
        shown = option(parameter, text) if parameter else text
        raise MconvError(f"{shown} {'is not a directory' if path.exists() else 'does not exist'}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    cache = constants.HF_HUB_CACHE
    at = f" at revision {revision}" if revision else ""
    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    def download(patterns: list[str]) -> Path:
        # Offline, transformers asks for local files only (a commit hash would otherwise still be fetched).
        return Path(snapshot_download(text, revision=revision, local_files_only=constants.HF_HUB_OFFLINE,
                                      allow_patterns=CONFIG_PATTERNS + patterns))

    try:
        folder = download(WEIGHT_PATTERNS if weights else [])
        if weights and not any(folder.glob("*.safetensors")):
            folder = download(BIN_PATTERNS)
        # The remote code the configs name, and what it imports, are known only once they are here:
        # fetched from the same commit until the files named stop growing (remote_code_files).
        fetched: list[str] = []
        while (code := _remote_code(folder)) != fetched:
            snapshot_download(text, revision=folder.name, local_files_only=constants.HF_HUB_OFFLINE,
                              allow_patterns=code)
            fetched = code
    except HFValidationError:
        raise MconvError(f"{text} is not a directory, nor a hub model name such as Qwen/Qwen3-8B") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:  # GatedRepoError is a RepositoryNotFoundError
        what = "is gated (log in with `hf auth login` after accepting its terms)" if isinstance(e, GatedRepoError) \
            else "was not found on the Hugging Face Hub"
        raise MconvError(f"{text}{at} is not a local directory and {what}; the hub cache is {cache}") from None
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
               f"the Hub could not be reached: {type(e.__cause__ or e).__name__}")
        raise MconvError(f"{text}{at} is not a local directory and is not in the Hugging Face cache {cache} "
                         f"({why})") from None
    except OSError as e:  # a partial snapshot offline, a full disk, a network error mid-download
        raise MconvError(f"{text}{at}: fetching it into the Hugging Face cache {cache} failed: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    finally:
        if quiet:
            enable_progress_bars()
    if weights and not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise MconvError(f"{text}{at} (in {folder}) has no safetensors or pytorch_model*.bin weights")
    return folder

