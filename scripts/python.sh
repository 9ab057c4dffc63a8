# Sourced by the install scripts and demo.sh.
# find_python [VERSION]: prints a Python VERSION interpreter (default 3.12; MCONV_PYTHON for 3.12,
# MCONV_PYTHON310 for 3.10, then pythonVERSION on PATH, then pyenv's) or says how to name one.
find_python() {
    local version="${1:-3.12}" var=MCONV_PYTHON
    [ "$version" = 3.12 ] || var="MCONV_PYTHON${version/./}"
    for candidate in "${!var:-}" "python$version" "$HOME"/.pyenv/versions/"$version".*/bin/python"$version"; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$version'" 2>/dev/null; then
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
find_uv() {
    if ! [ -x .uv/bin/uv ] || [ "$(.uv/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
        "$(find_python)" -m pip install --quiet --target .uv --upgrade "uv==$UV_VERSION" >&2
    fi
    echo "$PWD/.uv/bin/uv"
}
