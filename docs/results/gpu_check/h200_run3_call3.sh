# gpu-check run 3, device call 3: what turning Triton's fp fusion off costs the packing kernels:
# Ran with the code of that moment: every CUDA kernel compiled with fp fusion off (_INDUCTOR_OPTIONS_CUDA);
# the committed fix narrows it to the quantizer kernels (comm.kernels.eager_float), not run on a GPU.
# bench.packing at 250M with the CUDA options as before the fix (fusion on) and as fixed (off),
# back to back in one call on one machine. Run from the repo root; $OUT collects.
export PYTHONPATH=$PWD:$PWD/.gpucheck/site LIONCUB_CACHE=$PWD/.gpucheck/cache PYTHONUNBUFFERED=1 WANDB_MODE=disabled
for mode in on off on off; do
  timeout 60 python3 -c "
import sys
from comm import kernels as K
if sys.argv[1] == 'on':
    K._INDUCTOR_OPTIONS_CUDA = dict(K._INDUCTOR_OPTIONS)
from bench.packing import main
print('=== fp fusion', sys.argv[1], K._INDUCTOR_OPTIONS_CUDA)
main(['--device', 'cuda', '--repeats', '7', '--n', '250M'])
" $mode 2>&1 | grep -E "===|copy_ of|quantize|sign ->|majority|sum" | tee -a $OUT/fusion_on_off.log
done
