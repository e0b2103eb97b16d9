# Sourced by the device-call scripts: SANITIZER is the compute-sanitizer to run. The image's
# (2025.3.1, CUDA 13.0) reports hazards that the bulk copies order, and at times write-write pairs
# on block-sparse ordered dQ; 2026.4 (CUDA 13.5, the PyPI wheel nvidia-cuda-sanitizer-api) reports
# neither on the same build, only the schedule slots' mbarrier-ordered pairs that both report
# (benchmarks/NOTES.md, thirty-third session). Carry the wheel in .carry/sanwhl/ (or name it in
# SANITIZER_WHEEL) to use it.
_san_wheel=${SANITIZER_WHEEL:-$(ls .carry/sanwhl/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | tail -1)}
SANITIZER=compute-sanitizer
if [ -n "$_san_wheel" ]; then
  _san_dir=/tmp/sanitizer_wheel/$(basename "$_san_wheel" .whl)  # one folder per wheel version
  [ -x $_san_dir/nvidia/cu13/compute-sanitizer/compute-sanitizer ] ||
    { mkdir -p $_san_dir && python3 -m zipfile -e "$_san_wheel" $_san_dir && chmod +x $_san_dir/nvidia/cu13/compute-sanitizer/*; }
  SANITIZER=$_san_dir/nvidia/cu13/compute-sanitizer/compute-sanitizer
fi
echo "sanitizer: $($SANITIZER --version | tail -1)"
