#!/usr/bin/env bash
# Runs the TE source's GPU tests on the device host, after .te/kit/install-te.sh installed TE 2.20.2.
# From the repository root:  bash tests/gpu/run_te_tests.sh [pytest args]   (logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/te-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# fp8guard itself, editable and without its dependencies (torch is the host's; no network there).
if ! python3 -c "import fp8guard.agent.sources.te" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
fi
python3 - <<'PY' 2>&1 | grep -v -i warn | tee "$OUT/env.txt"
import torch, transformer_engine, transformer_engine.pytorch as te, fp8guard.agent.sources.te as s
print("torch", torch.__version__, "te", transformer_engine.__version__, torch.cuda.get_device_name(),
      "sm", torch.cuda.get_device_capability(), "fp8", te.is_fp8_available(),
      "block", te.is_fp8_block_scaling_available(), "source", s.__file__)
PY
python3 -m pytest -q -p no:cacheprovider -rA --durations=5 tests/agent/test_te_source_*.py "$@" 2>&1 \
  | tee "$OUT/pytest.txt" | grep -v -E "^(PASSED|SKIPPED) " | tail -n 150
echo "pytest exit ${PIPESTATUS[0]}"
if [ -f tests/gpu/te_read_cost.py ]; then
  timeout 120 python3 tests/gpu/te_read_cost.py 2>&1 | grep -v -i warn | tee "$OUT/read_cost.txt"
fi
