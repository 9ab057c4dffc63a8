# Sourced by the install scripts and demo.sh.
# find_python [VERSION]: prints a Python VERSION interpreter (default 3.12; MCONV_PYTHON for 3.12,
# MCONV_PYTHON310 for 3.10, then pythonVERSION on PATH, then pyenv's) or says how to name one.
find_python() {
    local version="${1:-3.12}" var=MCONV_PYTHON
    [ "$version" = 3.12 ] || var="MCONV_PYTHON${version/./}"
    local check="import sys; assert '%d.%d' % sys.version_info[:2] == '$version'"
    if [ -n "${!var:-}" ] && ! "${!var}" -c "$check" 2>/dev/null; then  # a named choice is not passed over
        echo "mconv: error: $var=${!var} is not a Python $version interpreter" >&2
        return 1
    fi
    for candidate in "${!var:-}" "python$version" "$HOME"/.pyenv/versions/"$version".*/bin/python"$version"; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c "$check" 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    echo "mconv: error: Python $version not found (set $var=/path/to/python$version)" >&2
    return 1
}

# find_uv: prints the uv binary the install scripts use (pinned; put in .uv/ by pip on first use).
# uv fetches wheels in parallel and installs them by hard link from its cache: the CUDA torch wheel
# and its NVIDIA libraries are most of an install's time under pip.
UV_VERSION=0.13.9
# uv writes each installed module's bytecode (.pyc) at install time. Without it, an environment with
# PYTHONDONTWRITEBYTECODE=1 (this project's VMs and CI have it) compiles torch, megatron-core and
# transformers from source in every new interpreter: 44 s of CPU to import them on the 2-core VM, 15 s
# with the bytecode, and the test suite starts several hundred interpreters (ranks, CLIs, vLLM).
export UV_COMPILE_BYTECODE=1
find_uv() {
    if ! [ -x .uv/bin/uv ] || [ "$(.uv/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
        local python
        python="$(find_python)" || return 1
        "$python" -m pip install --quiet --root-user-action=ignore --target .uv --upgrade "uv==$UV_VERSION" >&2
    fi
    echo "$PWD/.uv/bin/uv"
}

# install_transformers_4 VENV: transformers 4.57 beside VENV's own, in VENV/tf-4.57, for the tests that
# run it with PYTHONPATH pointing there (test_qwen3_vl's 4.x loads, test_bin_checkpoints' .bin files).
# It needs huggingface_hub < 1.0, tokenizers <= 0.23.0 and requests, which ours do not have: those go
# into the same dir, shadowing the venv's only in that subprocess. Uses $UV (find_uv).
install_transformers_4() {
    [ -d "$1/tf-4.57/transformers" ] && return 0
    "$UV" pip install --quiet --python "$1/bin/python" --no-deps --only-binary=:all: --target "$1/tf-4.57" \
        transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 requests==2.34.2 urllib3==2.8.0 \
        charset_normalizer==3.5.3
}
