# Sourced by the host scripts: use_wheels DIR TARGET installs the wheels in DIR (no deps, no
# index) into TARGET and puts TARGET first on PYTHONPATH, ahead of the host's packages (e.g. an
# onnxruntime >= 1.32 where the host's is older). Returns pip's status; $PY is the interpreter.
use_wheels() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$2" "$1"/*.whl || return
  export PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}"
}
