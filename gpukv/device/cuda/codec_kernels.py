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

/* sign: a CUDA block of 256 threads takes 4 blocks of 64 values (host_codecs.SIGN_BLOCK)
   at a time, a thread per value. The payload is the blocks' float32 scales, then the bits
   (32 values per 32-bit word). */
extern "C" __global__ void gpukv_quantize_sign(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nblocks) {
    __shared__ float sums[256];
    __shared__ unsigned char bits[256];
    float* scales = (float*)out;
    unsigned char* packed = out + 4 * nblocks;
    const long long nbits_bytes = 4 * ((n + 31) / 32);
    const long long groups = (n + 255) / 256;
    const int t = threadIdx.x, lane = t & 63, first = t - lane;
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        long long i = g * 256 + t;
        float r = 0.0f;
        if (i < n) r = __fadd_rn(residual[i], grad[i]);
        sums[t] = __fmul_rn(r, r);
        __syncthreads();
        for (int h = 32; h > 0; h >>= 1) {  /* the halves host_codecs adds, in its order */
            if (lane < h) sums[t] = __fadd_rn(sums[t], sums[t + h]);
            __syncthreads();
        }
        long long b = g * 4 + (t >> 6);  /* this thread's block of 64 values */
        long long left = n - b * 64;
        float scale = left > 0 ? __fsqrt_rn(__fdiv_rn(sums[first],
                                                      (float)(left < 64 ? left : 64)))
                               : 0.0f;
        bool positive = r >= 0.0f;
        bits[t] = (i < n && positive) ? 1 : 0;
        if (i < n) residual[i] = __fsub_rn(r, positive ? scale : -scale);
        __syncthreads();
        long long byte = b * 8 + lane;
        if (lane < 8 && byte < nbits_bytes) {
            unsigned char v = 0;
            for (int k = 0; k < 8; ++k)
                v |= (unsigned char)(bits[first + 8 * lane + k] << (7 - k));
            packed[byte] = v;
        }
        if (lane == 0 && b < nblocks) scales[b] = scale;
        __syncthreads();  /* sums and bits are the next values' */
    }
}

extern "C" __global__ void gpukv_dequantize_sign(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        long long nblocks, int accumulate) {
    const float* scales = (const float*)in;
    const unsigned char* packed = in + 4 * nblocks;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float s = scales[i >> 6];
        float v = ((packed[i >> 3] >> (7 - (int)(i & 7))) & 1) ? s : -s;
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

/* ternary: a CUDA block of 256 threads takes 2 blocks of 128 values
   (host_codecs.TERNARY_BLOCK) at a time, a thread per value. The payload is the blocks'
   float32 scales, then each block's 26 bytes of codes, five to a byte (the first value
   the lowest base-3 digit; 0: 0, 1: +scale, 2: -scale). */
extern "C" __global__ void gpukv_quantize_ternary(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nblocks) {
    __shared__ float sums[256];
    __shared__ int counts[256];
    __shared__ unsigned char codes[256];
    float* scales = (float*)out;
    unsigned char* packed = out + 4 * nblocks;
    const long long groups = (n + 255) / 256;
    const int t = threadIdx.x, lane = t & 127, first = t - lane;
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        long long i = g * 256 + t;
        float r = 0.0f;
        if (i < n) r = __fadd_rn(residual[i], grad[i]);
        float size = fabsf(r);
        sums[t] = size;
        __syncthreads();
        for (int h = 64; h > 0; h >>= 1) {  /* the halves host_codecs adds, in its order */
            if (lane < h) sums[t] = __fadd_rn(sums[t], sums[t + h]);
            __syncthreads();
        }
        long long b = g * 2 + (t >> 7);  /* this thread's block of 128 values */
        long long left = n - b * 128;
        float mean = left > 0 ? __fdiv_rn(sums[first], (float)(left < 128 ? left : 128))
                              : 0.0f;
        bool chosen = i < n && size > __fmul_rn(mean, 0.7f);
        __syncthreads();  /* every thread has read its block's sum */
        sums[t] = chosen ? size : 0.0f;
        counts[t] = chosen ? 1 : 0;
        __syncthreads();
        for (int h = 64; h > 0; h >>= 1) {
            if (lane < h) {
                sums[t] = __fadd_rn(sums[t], sums[t + h]);
                counts[t] += counts[t + h];
            }
            __syncthreads();
        }
        int count = counts[first];
        float scale = count > 0 ? __fdiv_rn(sums[first], (float)count) : 0.0f;
        unsigned char code = chosen ? (r > 0.0f ? 1 : 2) : 0;
        codes[t] = code;
        float sent = code == 0 ? 0.0f : (code == 1 ? scale : -scale);
        if (i < n) residual[i] = __fsub_rn(r, sent);
        __syncthreads();
        if (lane < 26 && b < nblocks) {
            int v = 0, p = 1;
            for (int k = 0; k < 5; ++k) {
                int j = 5 * lane + k;
                if (j < 128) v += codes[first + j] * p;
                p *= 3;
            }
            packed[b * 26 + lane] = (unsigned char)v;
        }
        if (lane == 0 && b < nblocks) scales[b] = scale;
        __syncthreads();  /* sums, counts and codes are the next values' */
    }
}

extern "C" __global__ void gpukv_dequantize_ternary(
        const unsigned char* __restrict__ in, float* __restrict__ out, long long n,
        long long nblocks, int accumulate) {
    const float* scales = (const float*)in;
    const unsigned char* packed = in + 4 * nblocks;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long b = i >> 7;
        int j = (int)(i & 127);
        int code = packed[b * 26 + j / 5];
        for (int k = j % 5; k > 0; --k) code /= 3;
        code %= 3;
        float s = scales[b];
        float v = code == 0 ? 0.0f : (code == 1 ? s : -s);
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
