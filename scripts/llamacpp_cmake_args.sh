#!/bin/sh
# Prints the CMAKE_ARGS that build llama-cpp-python's llama.cpp for this CPU: the x86 kernels its
# flags list (AVX-512 with VNNI, VBMI and BF16 where present, which makes a llama.cpp draft token
# about twice as cheap as the AVX2 build's), and never the AMX tiles, which some VMs list but fault
# on. A native build (-DGGML_NATIVE=ON) would pick those up. Not x86: llama.cpp's own defaults.
#   CMAKE_ARGS="$(sh scripts/llamacpp_cmake_args.sh)" pip install llama-cpp-python
case "$(uname -m)" in
  x86_64|amd64) ;;
  *) exit 0 ;;
esac
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do case "$flags" in *" $f "*) ;; *) return 1 ;; esac; done; }
args="-DGGML_NATIVE=OFF"
has avx && args="$args -DGGML_AVX=ON"
has avx2 fma f16c && args="$args -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
has bmi2 && args="$args -DGGML_BMI2=ON"
if has avx512f avx512cd avx512vl avx512dq avx512bw; then
  args="$args -DGGML_AVX512=ON"
  has avx512_vnni && args="$args -DGGML_AVX512_VNNI=ON"
  has avx512vbmi && args="$args -DGGML_AVX512_VBMI=ON"
  has avx512_bf16 && args="$args -DGGML_AVX512_BF16=ON"
fi
echo "$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
