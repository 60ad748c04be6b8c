"""The CUDA kernels of the gradient-compression codecs, launched by `gpukv.device.codecs`
for GPU arrays (their NumPy twins are `gpukv/device/host_codecs.py`). One thread writes
one payload byte (encoders) or one value (decoders); every float32 add is `__fadd_rn`, so
no multiply-add is fused and the bits are the twins' (CuPy compiles with -ftz=true:
float32 subnormals flush to zero here, not there). CuPy is imported only when a kernel
is launched.
"""
from __future__ import annotations

import functools

#: the compression kernels' CUDA source (also compiled by `gpukv info --kernels`)
CUDA_SOURCE = r"""
extern "C" __global__ void gpukv_quantize_2bit(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nbytes, float t) {
    const unsigned char posbits[4] = {0xc0, 0x30, 0x0c, 0x03};
    const unsigned char negbits[4] = {0x80, 0x20, 0x08, 0x02};
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < nbytes;
         b += (long long)gridDim.x * blockDim.x) {
        unsigned char byte = 0;
        long long start = b * 4;
        for (int k = 0; k < 4; ++k) {
            long long i = start + k;
            if (i >= n) break;
            float r = __fadd_rn(residual[i], grad[i]);
            if (r >= t) { byte |= posbits[k]; r = __fsub_rn(r, t); }
            else if (r <= -t) { byte |= negbits[k]; r = __fadd_rn(r, t); }
            residual[i] = r;
        }
        out[b] = byte;
    }
}

extern "C" __global__ void gpukv_dequantize_2bit(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        float t, int accumulate) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        int shift = 6 - 2 * (int)(i & 3);
        int code = (in[i >> 2] >> shift) & 3;
        float v = code == 3 ? t : (code == 2 ? -t : 0.0f);
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

extern "C" __global__ void gpukv_quantize_1bit(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nbytes, float t) {
    for (long long b = blockIdx.x * (long long)blockDim.x + threadIdx.x; b < nbytes;
         b += (long long)gridDim.x * blockDim.x) {
        unsigned char byte = 0;
        long long start = b * 8;
        for (int k = 0; k < 8; ++k) {
            long long i = start + k;
            if (i >= n) break;
            float r = __fadd_rn(residual[i], grad[i]);
            if (r > t) { byte |= (unsigned char)(0x80 >> k); r = __fsub_rn(r, 1.0f); }
            else { r = __fadd_rn(r, 1.0f); }
            residual[i] = r;
        }
        out[b] = byte;
    }
}

extern "C" __global__ void gpukv_dequantize_1bit(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        int accumulate) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = ((in[i >> 3] >> (7 - (int)(i & 7))) & 1) ? 1.0f : -1.0f;
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}
"""


#: NVRTC options of `CUDA_SOURCE` (CuPy adds -arch and a few of its own)
COMPILE_OPTIONS = ()


@functools.cache
def _module(device_id: int):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=CUDA_SOURCE, options=COMPILE_OPTIONS)


def launch(name, items, args):
    import cupy
    fn = _module(cupy.cuda.Device().id).get_function(name)
    threads = 256
    blocks = max(1, min(-(-items // threads), 65535))
    fn((blocks,), (threads,), args)
