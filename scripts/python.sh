# Sourced by install.sh and demo.sh: find_python prints a Python 3.12 interpreter (MCONV_PYTHON,
# python3.12, then pyenv's) or says how to name one.
find_python() {
    for candidate in "${MCONV_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    echo "mconv: error: Python 3.12 not found (set MCONV_PYTHON=/path/to/python3.12)" >&2
    return 1
}
