# Sourced by the device-call scripts: SANITIZER is the compute-sanitizer to run. The image's
# (2025.3.1, CUDA 13.0) reports racecheck hazards that the mbarriers and bulk copies order, and a
# family of write-write pairs on block-sparse ordered dQ; 2026.4 (CUDA 13.5, the PyPI wheel
# nvidia-cuda-sanitizer-api) reports neither on the same build (benchmarks/NOTES.md, thirty-third
# session). Carry the wheel in .carry/sanwhl/ (or name it in SANITIZER_WHEEL) to use it.
wheel=${SANITIZER_WHEEL:-$(ls .carry/sanwhl/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | tail -1)}
SANITIZER=compute-sanitizer
if [ -n "$wheel" ]; then
  dir=/tmp/sanitizer_wheel
  [ -x $dir/nvidia/cu13/compute-sanitizer/compute-sanitizer ] ||
    { mkdir -p $dir && python3 -m zipfile -e "$wheel" $dir && chmod +x $dir/nvidia/cu13/compute-sanitizer/*; }
  SANITIZER=$dir/nvidia/cu13/compute-sanitizer/compute-sanitizer
fi
echo "sanitizer: $($SANITIZER --version | tail -1)"
