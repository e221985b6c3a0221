#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md, on the device host, after TE was staged there
# (bash .te/kit/install-te.sh). From the repository root:
#   bash bench/gpu_suite.sh counts     # exact counts: checked against TE, then timed
#   bash bench/gpu_suite.sh kernel-ab  # the count kernel's candidate settings side by side (no TE needed)
#   bash bench/gpu_suite.sh counts-profile  # where a counted step's time goes (profilers, then real-time parts)
#   bash bench/gpu_suite.sh overhead   # every-step telemetry overhead and sync check
#   bash bench/gpu_suite.sh host-cost  # monitor.step host time at 12-96 TE layers, then 604M and 48-layer ratios
#   bash bench/gpu_suite.sh host-cost-keep  # the same with MonitorConfig(grad_buffer=True), set_to_none=False
#   bash bench/gpu_suite.sh host-cost-48  # the 48-layer ratio alone, 20 rounds: its verdict against 1.005x
#   bash bench/gpu_suite.sh counts-time-ten  # every 10th step, staggered, batched: TE's questions answered
#                                            # by fp8guard, or routed by nvdlfw-inspect
#   bash bench/gpu_suite.sh counts-time-step  # every step, batched, and TE's debug path alone, both ways
#   bash bench/gpu_suite.sh heal       # the FP8 instability, three ways ($HEAL_ARGS passed on)
#   bash bench/gpu_suite.sh heal-1e4   # the 1e4 outlier ($HEAL_1E4_ARGS passed on, e.g. --noise:
#                                      # the unguarded run twice, run-to-run noise; --deterministic)
#   bash bench/gpu_suite.sh te-tests   # the TE source's GPU tests
#   bash bench/gpu_suite.sh counts-floor  # the kernels' timing and launch costs alone (no sweep, no TE)
#   bash bench/gpu_suite.sh count-tests  # the count kernels' GPU tests (no TE needed)
#   bash bench/gpu_suite.sh tripwire-tests  # the tripwire's one-launch check against its torch ops, compiled
#   bash bench/gpu_suite.sh torchao    # torchao float8 (tensorwise, rowwise): values, overhead, fallback
#   bash bench/gpu_suite.sh torchao-overhead  # torchao float8: values (both ways) and overhead only, ~2.5 min
#   bash bench/gpu_suite.sh torchao-tests  # the torchao source's CPU tests against the installed torchao
# Several names run in order. Logs and JSON results go to $OUT (two files per part).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import fp8guard.agent.sources.te_inspect" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
fi

part() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  grep -v -i -E "warn|deprecat" "$OUT/$name.log" | tail -c 2500
  echo
}

for what in "$@"; do
  case "$what" in
    counts)
      part counts_verify 240 python3 bench/gpu_counts.py verify --out "$OUT"
      part counts_verify_current 240 python3 bench/gpu_counts.py verify --recipe current --out "$OUT"
      part counts_kernels 420 python3 bench/gpu_counts.py kernels --out "$OUT"
      part counts_time 300 python3 bench/gpu_counts.py time --out "$OUT" ;;
    counts-profile)
      part counts_profile 150 python3 bench/gpu_counts.py profile --out "$OUT"
      part counts_parts 130 python3 bench/gpu_counts.py parts --rounds 8 --block 4 --settle 1 --budget-s 80 --out "$OUT" ;;
    counts-floor)
      # the kernels' timing and launch_floor alone (host time per launch and per batched operand), about a minute
      part counts_floor 150 python3 bench/gpu_counts.py kernels --parts timing,launch_floor --tag .floor --out "$OUT" ;;
    counts-kernels)
      # (six variants swept at twelve launch shapes since the twelfth session: about twice the
      # eleventh session's 60-91 s)
      part counts_kernels 420 python3 bench/gpu_counts.py kernels --out "$OUT" ;;
    kernel-ab)
      # the kernel as it is against its candidate settings (bench/_count_probe.py's SETTINGS), rounds
      # alternating; python3 bench/gpu_count_kernel_ab.py --old <counts.py> adds another version's
      part kernel_ab 300 python3 bench/gpu_count_kernel_ab.py --out "$OUT" ;;
    overhead)
      part overhead 240 python3 bench/gpu_overhead.py --out "$OUT" ;;
    host-cost)
      # two calls' worth: the depth sweep (about 2-3 min), then the side-by-side ratios (about 4 min)
      part host_cost_sweep 240 python3 bench/gpu_host_cost.py --parts sweep --budget-s 180 \
        --out "$OUT/gpu_host_cost.sweep.json"
      part host_cost_ratios 290 python3 bench/gpu_host_cost.py --parts ratios --budget-s 200 \
        --out "$OUT/gpu_host_cost.ratios.json" ;;
    host-cost-keep)
      # the same two parts with the gradients zeroed in place and kept in the monitor's buffer
      # (MonitorConfig(grad_buffer=True)); the ratios part first measures what zeroing in place costs
      part host_cost_keep_sweep 200 python3 bench/gpu_host_cost.py --grads keep --parts sweep --budget-s 150 \
        --out "$OUT/gpu_host_cost.sweep_keep.json"
      part host_cost_keep_ratios 290 python3 bench/gpu_host_cost.py --grads keep --parts ratios --gc-between-blocks \
        --rounds 16 --budget-s 230 --out "$OUT/gpu_host_cost.ratios_keep.json" ;;
    heal|heal-1e4)
      # The in-process fp8guard service needs the service's packages, which the GPU image lacks:
      # carried as wheels in .whl/ (see docs/gpu.md).
      if ! python3 -c "import uvicorn, fastapi, sqlalchemy, alembic, pydantic_settings" 2>/dev/null && [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
      fi
      if [ "$what" = heal ]; then
        # shellcheck disable=SC2086  # HEAL_ARGS is a list of flags
        part heal 300 python3 bench/gpu_heal.py --out "$OUT" ${HEAL_ARGS:-}
      else
        mkdir -p "$OUT/heal_1e4"
        # shellcheck disable=SC2086  # HEAL_1E4_ARGS is a list of flags
        part heal_1e4 280 python3 bench/gpu_heal.py --outlier 1e4 --out "$OUT/heal_1e4" ${HEAL_1E4_ARGS:-}
      fi ;;
    counts-time)
      part counts_time 240 python3 bench/gpu_counts.py time --out "$OUT" ;;
    counts-time-ten)
      # counting every 10th step only, staggered, batched (the defaults), with TE's debug questions
      # answered by fp8guard (te_inspect.answer_directly, the default) or routed by nvdlfw-inspect
      # (the _routed mode, as until the sixteenth session), 20 rounds (~3.5 min)
      part counts_time_ten 260 python3 bench/gpu_counts.py time --modes \
        agent_no_counts,counts_every_10_staggered_batched,counts_every_10_staggered_batched_routed --rounds 20 \
        --tag .ten --out "$OUT" ;;
    counts-time-step)
      # counting every step, and TE's debug path alone, each answered directly and routed (~2.5 min)
      part counts_time_step 240 python3 bench/gpu_counts.py time --modes \
        agent_no_counts,counts_every_step_batched,counts_every_step_batched_routed,debug_path_only,debug_path_only_routed \
        --rounds 10 --tag .step --out "$OUT" ;;
    host-cost-48)
      # the 48-layer model's ratio alone, 20 rounds, with its interval and verdict (~5 min)
      part host_cost_48 500 python3 bench/gpu_host_cost.py --parts ratios --ratio-models 48x1024 --rounds 20 \
        --gc-between-blocks --budget-s 420 --out "$OUT/gpu_host_cost.ratios48.json" ;;
    torchao|torchao-tests|torchao-overhead)
      # The GPU image has no torchao: the wheel is carried in .whl/ (--no-deps: it needs only torch).
      if ! python3 -c "import torchao.float8" 2>/dev/null; then
        if ls .whl/torchao-*.whl >/dev/null 2>&1; then
          python3 -m pip install -q --no-index --no-deps .whl/torchao-*.whl 2>&1 | tail -2
        else
          echo "no torchao and no .whl/torchao-*.whl: the torchao part will skip" >&2
        fi
      fi
      if [ "$what" = torchao ]; then
        # about 2.5 min: the bench paces its timing rounds to --budget-s (150 s) and writes
        # gpu_torchao.json after each recipe, and on SIGTERM from this timeout
        part torchao 220 python3 bench/gpu_torchao.py --out "$OUT"
      elif [ "$what" = torchao-overhead ]; then
        part torchao_overhead 240 python3 bench/gpu_torchao.py --parts values,overhead --out "$OUT"
      else
        part torchao_tests 150 python3 -m pytest -q -p no:cacheprovider tests/agent/test_torchao_source.py \
          tests/agent/test_remediation.py -k "torchao or fallback or promote"
      fi ;;
    te-tests)
      part te_tests 180 python3 -m pytest -q -p no:cacheprovider tests/agent/test_te_source_*.py -x ;;
    count-tests)
      # the count kernels' GPU tests (one launch each, eight a launch, through the compiled handles)
      part count_tests 240 python3 -m pytest -q -p no:cacheprovider tests/agent/test_count_batch.py \
        tests/agent/test_compiled_launch.py ;;
    tripwire-tests)
      # every test of both files: the CUDA ones (kernel against torch ops, compiled; no sync) and the
      # interpreter's (each in a fresh process)
      part tripwire_tests 240 python3 -m pytest -q -p no:cacheprovider -m "" tests/agent/test_tripwire_kernel.py \
        tests/agent/test_tripwire.py ;;
    *) echo "unknown part $what" >&2; exit 2 ;;
  esac
done
