#!/usr/bin/env bash
# One command for a GPU machine without network: the CUDA tests and the GPU benchmarks on a
# world of one, within about ten minutes. Installs nothing: it uses the Python and torch it
# finds (.venv if there is one) and skips peers that are absent.
#     bash benchmarks/gpu.sh            # from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== versions"
"$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print(f"gpu {i}:", torch.cuda.get_device_name(i))
for peer in ("torch_geometric", "dgl", "transformers", "numba"):
    try:
        mod = __import__(peer)
        print(peer, getattr(mod, "__version__", "?"))
    except Exception as e:  # a missing or broken peer is skipped, not fatal
        print(peer, "absent:", type(e).__name__)
PYEOF
status=0
echo "== tests: CUDA against CPU, and the device-neutrality check"
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_device.py -rs || status=1
echo "== link prediction on the GPU: edge batches and the full graph (2 epochs each)"
for mode in minibatch full; do
    "$PY" -m gnnpar.cli train link --dataset sbm --device cuda --mode "$mode" --model gcn \
        --epochs 2 --quiet --overwrite --out "${TMPDIR:-/tmp}/gnnpar-gpu-link-$mode" || status=1
done
echo "== a mixture-of-experts GPT on the GPU (4 experts, top 2, ZeRO-3; 20 steps)"
"$PY" -m gnnpar.cli train gpt --moe-experts 4 --device cuda --n-layer 2 --n-embd 128 \
    --n-head 4 --steps 20 --eval-every 0 --sample-tokens 0 --zero-stage 3 --quiet \
    --overwrite --out "${TMPDIR:-/tmp}/gnnpar-gpu-moe" || status=1
echo "== snapshots every step on the GPU (device tensors written to host memory; 12 steps)"
"$PY" -m gnnpar.cli train gpt --device cuda --n-layer 2 --n-embd 128 --n-head 4 --steps 12 \
    --eval-every 0 --sample-tokens 0 --snapshot-every 1 --quiet --overwrite \
    --snapshot-dir "${TMPDIR:-/tmp}/gnnpar-gpu-snapshots" \
    --out "${TMPDIR:-/tmp}/gnnpar-gpu-snapshot" || status=1
echo "== snapshot cost per step on the GPU: the benchmark GPT (chaos.py's, one rank) without and"
echo "   with --snapshot-every 1, 40 steps each, 2 interleaved rounds; median wall step (issue: <= 1.05x)"
snaps="${TMPDIR:-/tmp}/gnnpar-gpu-snapcost"
for round in 1 2; do
    for every in 0 1; do
        "$PY" -m gnnpar.cli train gpt --device cuda --n-layer 4 --n-embd 256 --n-head 4 \
            --block-size 128 --batch-size 8 --vocab-size 512 --steps 40 --eval-every 0 \
            --sample-tokens 0 --snapshot-every "$every" --snapshot-dir "$snaps-shm" --quiet \
            --overwrite --out "$snaps-$every-$round" || status=1
    done
done
"$PY" - "$snaps" <<'PYEOF' || status=1
import statistics, sys
from gnnpar.train.metrics import read_metrics
def steps(out):  # wall time from one logged step to the next, past the first 5
    t = [r["time"] for r in read_metrics(f"{out}/metrics.jsonl") if "seconds" in r]
    return [b - a for a, b in zip(t[5:], t[6:])]
side = {e: statistics.median(s for r in (1, 2) for s in steps(f"{sys.argv[1]}-{e}-{r}")) for e in (0, 1)}
print(f"step without {side[0] * 1e3:.1f} ms, with snapshots {side[1] * 1e3:.1f} ms: "
      f"{side[1] / side[0]:.3f}x")
PYEOF
echo "== benchmarks"
"$PY" benchmarks/gpu.py "$@" || status=1
exit $status
