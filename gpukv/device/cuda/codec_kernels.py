"""The CUDA kernels of the gradient-compression codecs, launched by `gpukv.device.codecs`
for GPU arrays (their NumPy twins are `gpukv/device/host_codecs.py`). One kernel per codec
and direction, each one pass over memory: a thread per value (per payload byte for 2bit's
encoder, four values at a time for fp16 and bf16), a warp per block of sign or ternary
values. Every float32 add is `__fadd_rn`, so no multiply-add is fused and the bits are the
twins' (CuPy compiles with -ftz=true: float32 subnormals flush to zero here, not there).
CuPy is imported only when a kernel is launched.
"""
from __future__ import annotations

import functools

from .kernels import CONVERSIONS

#: the compression kernels' CUDA source (also compiled by `gpukv info --kernels`)
CUDA_SOURCE = CONVERSIONS + r"""
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

/* Eight 0/1 bytes as one byte of bits, the first the most significant (1bit's and sign's
   layout). */
__device__ __forceinline__ unsigned char gpukv_pack8(const unsigned char* b) {
    return (unsigned char)((b[0] << 7) | (b[1] << 6) | (b[2] << 5) | (b[3] << 4)
                           | (b[4] << 3) | (b[5] << 2) | (b[6] << 1) | b[7]);
}

/* 1bit: a thread per value, a CUDA block's 256 values at a time; their bits meet in
   shared memory (one of two halves, taken in turn, so one barrier a round keeps a round's
   writes from the bytes the last round is still packing) and 32 threads pack them. */
extern "C" __global__ void gpukv_quantize_1bit(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nbytes, float t) {
    __shared__ unsigned char bits[2][256];
    const long long groups = (n + 255) / 256;
    const int lane = threadIdx.x;
    int turn = 0;
    for (long long g = blockIdx.x; g < groups; g += gridDim.x, turn ^= 1) {
        long long i = g * 256 + lane;
        unsigned char bit = 0;
        if (i < n) {
            float r = __fadd_rn(residual[i], grad[i]);
            if (r > t) { bit = 1; r = __fsub_rn(r, 1.0f); }
            else { r = __fadd_rn(r, 1.0f); }
            residual[i] = r;
        }
        bits[turn][lane] = bit;
        __syncthreads();
        long long byte = g * 32 + lane;
        if (lane < 32 && byte < nbytes) {
            out[byte] = gpukv_pack8(bits[turn] + 8 * lane);
        }
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

/* The sum of a warp's 32 values `v` (one a lane), added as host_codecs adds its halves:
   16 apart, then 8, ..., 1. Every lane reads the 32 values from `sh` (32 slots of its
   warp's own) and adds the tree in registers: two warp barriers, and every lane has the
   total. */
__device__ __forceinline__ float gpukv_warp_halves(float* sh, int lane, float v) {
    sh[lane] = v;
    __syncwarp();
    float t[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) t[j] = __fadd_rn(sh[j], sh[j + 16]);
#pragma unroll
    for (int h = 8; h > 0; h >>= 1) {
#pragma unroll
        for (int j = 0; j < h; ++j) t[j] = __fadd_rn(t[j], t[j + h]);
    }
    __syncwarp();  /* every lane has read sh before it is written again */
    return t[0];
}

/* For a block whose sum by halves left float32's range: the largest magnitude m of the
   block's `width` values v (64 or 128, in shared memory, none a NaN), and, where m is
   finite and above 0, the sum by halves (x[i] += x[i + h], h = width / 2, ..., 1) of
   |v| / m, or of (v / m)**2 when `square`, in the tree of gpukv_warp_halves and the
   twins. Every lane adds the whole tree in its own registers, eight columns i + 8 k at
   a time: no barrier, so a warp may take it alone. */
__device__ __forceinline__ float gpukv_rescaled_halves(const float* v, int width, int square,
                                                       float* m_out) {
    float m = 0.0f;
    for (int j = 0; j < width; ++j) m = fmaxf(m, fabsf(v[j]));
    *m_out = m;
    if (!(m > 0.0f) || isinf(m)) return 0.0f;
    const int per = width / 8;  /* a column's values: 8 or 16 */
    float c[8];
    for (int i = 0; i < 8; ++i) {
        float x[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            float q = k < per ? __fdiv_rn(fabsf(v[i + 8 * k]), m) : 0.0f;
            x[k] = square ? __fmul_rn(q, q) : q;
        }
#pragma unroll
        for (int h = 8; h > 0; h >>= 1) {  /* the halves 64 (width 128), 32, 16 and 8 */
            if (h < per) {
#pragma unroll
                for (int k = 0; k < h; ++k) x[k] = __fadd_rn(x[k], x[k + h]);
            }
        }
        c[i] = x[0];
    }
#pragma unroll
    for (int h = 4; h > 0; h >>= 1) {  /* the halves 4, 2 and 1 */
#pragma unroll
        for (int i = 0; i < h; ++i) c[i] = __fadd_rn(c[i], c[i + h]);
    }
    return c[0];
}

__device__ __forceinline__ int gpukv_warp_count(int* sh, int lane, int v) {
    sh[lane] = v;
    __syncwarp();
    int total = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) total += sh[j];
    __syncwarp();
    return total;
}

/* sign: a warp per block of 64 values (host_codecs.SIGN_BLOCK), a lane taking values
   lane and lane + 32, so the halves 32 apart are added in the lane and the rest across
   the warp. A CUDA block's 8 warps take 8 blocks at a time, in step (the loop's count is
   the CUDA block's). The payload is the blocks' float32 scales, then the bits (32 values
   per 32-bit word). A block of finite values whose sum of squares is inf or below
   float32's smallest normal takes m * sqrt(the sum of (v / m)**2 / count), m its largest
   magnitude (above 0), as the twins do: from the values kept in shared memory. */
extern "C" __global__ void gpukv_quantize_sign(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nblocks) {
    __shared__ float sums[8][32];
    __shared__ float values[8][64];
    __shared__ unsigned char bits[8][64];
    float* scales = (float*)out;
    unsigned char* packed = out + 4 * nblocks;
    const long long nbits_bytes = 4 * ((n + 31) / 32);
    const long long groups = (nblocks + 7) / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const long long b = g * 8 + warp, first = b * 64;
        float r[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            long long i = first + lane + 32 * k;
            r[k] = i < n ? __fadd_rn(residual[i], grad[i]) : 0.0f;
            values[warp][lane + 32 * k] = r[k];  /* (read after the barrier below) */
        }
        float total = gpukv_warp_halves(sums[warp], lane,
                                        __fadd_rn(__fmul_rn(r[0], r[0]), __fmul_rn(r[1], r[1])));
        long long left = n - first;
        const float count = (float)(left < 64 ? left : 64);
        float scale = left > 0 ? __fsqrt_rn(__fdiv_rn(total, count)) : 0.0f;
        if (left > 0 && (isinf(total) || total < __int_as_float(0x00800000))) {  /* not NaN */
            float m;
            float s = gpukv_rescaled_halves(values[warp], 64, 1, &m);
            if (m > 0.0f && !isinf(m)) scale = __fmul_rn(m, __fsqrt_rn(__fdiv_rn(s, count)));
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            long long i = first + lane + 32 * k;
            bool positive = r[k] >= 0.0f;
            bits[warp][lane + 32 * k] = (i < n && positive) ? 1 : 0;
            if (i < n) residual[i] = __fsub_rn(r[k], positive ? scale : -scale);
        }
        __syncwarp();
        long long byte = b * 8 + lane;
        if (lane < 8 && byte < nbits_bytes) {
            packed[byte] = gpukv_pack8(bits[warp] + 8 * lane);
        }
        if (lane == 0 && b < nblocks) scales[b] = scale;
        __syncwarp();  /* bits and values are the next block's */
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

/* ternary: a warp per block of 128 values (host_codecs.TERNARY_BLOCK), a lane taking
   values lane + 32 k for k = 0..3, so the halves 64 and 32 apart are added in the lane
   and the rest across the warp; 8 warps in step, as for sign. The payload is the blocks'
   float32 scales, then each block's 26 bytes of codes, five to a byte (the first value the
   lowest base-3 digit; 0: 0, 1: +scale, 2: -scale). A block of finite values whose
   magnitudes sum to inf takes them divided by the largest, m, its scale then multiplied
   by m, as the twins do: from the magnitudes kept in shared memory. */
extern "C" __global__ void gpukv_quantize_ternary(
        const float* __restrict__ grad, float* __restrict__ residual,
        unsigned char* __restrict__ out, long long n, long long nblocks) {
    __shared__ float sums[8][32];
    __shared__ int counts[8][32];
    __shared__ float sizes[8][128];
    __shared__ unsigned char codes[8][128];
    float* scales = (float*)out;
    unsigned char* packed = out + 4 * nblocks;
    const long long groups = (nblocks + 7) / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
        const long long b = g * 8 + warp, first = b * 128;
        float r[4], size[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            long long i = first + lane + 32 * k;
            r[k] = i < n ? __fadd_rn(residual[i], grad[i]) : 0.0f;
            size[k] = fabsf(r[k]);
            sizes[warp][lane + 32 * k] = size[k];  /* (read after the barrier below) */
        }
        float total = gpukv_warp_halves(
            sums[warp], lane,
            __fadd_rn(__fadd_rn(size[0], size[2]), __fadd_rn(size[1], size[3])));
        float unit = 1.0f;  /* m, for a block rescaled */
        if (isinf(total)) {
            float m;
            float rescaled = gpukv_rescaled_halves(sizes[warp], 128, 0, &m);
            if (!isinf(m)) {  /* finite magnitudes (an inf: poisoned below) */
                unit = m;
                total = rescaled;
#pragma unroll
                for (int k = 0; k < 4; ++k) size[k] = __fdiv_rn(size[k], m);
            }
        }
        long long left = n - first;
        float mean = left > 0 ? __fdiv_rn(total, (float)(left < 128 ? left : 128)) : 0.0f;
        float bar = __fmul_rn(mean, 0.7f);
        const bool poisoned = !isfinite(bar);  /* an inf or NaN: the block crosses as NaN */
        bool chosen[4];
        float kept[4];
        int count = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            chosen[k] = first + lane + 32 * k < n && (poisoned || size[k] > bar);
            kept[k] = chosen[k] ? size[k] : 0.0f;
            count += chosen[k] ? 1 : 0;
        }
        float sent_sum = gpukv_warp_halves(
            sums[warp], lane,
            __fadd_rn(__fadd_rn(kept[0], kept[2]), __fadd_rn(kept[1], kept[3])));
        count = gpukv_warp_count(counts[warp], lane, count);
        float scale = poisoned ? __int_as_float(0x7fc00000)
                    : (count > 0 ? __fdiv_rn(sent_sum, (float)count) : 0.0f);
        if (unit != 1.0f) scale = __fmul_rn(scale, unit);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            long long i = first + lane + 32 * k;
            unsigned char code = chosen[k] ? (poisoned || r[k] > 0.0f ? 1 : 2) : 0;
            codes[warp][lane + 32 * k] = code;
            float sent = code == 0 ? 0.0f : (code == 1 ? scale : -scale);
            if (i < n) residual[i] = __fsub_rn(r[k], sent);
        }
        __syncwarp();
        if (lane < 26 && b < nblocks) {
            const unsigned char* c = codes[warp] + 5 * lane;
            int v = c[0] + 3 * c[1] + 9 * c[2];
            if (lane < 25) v += 27 * c[3] + 81 * c[4];  /* the last byte holds 3 values */
            packed[b * 26 + lane] = (unsigned char)v;
        }
        if (lane == 0 && b < nblocks) scales[b] = scale;
        __syncwarp();  /* codes and sizes are the next block's */
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
        int j = (int)(i & 127), digit = j % 5;
        /* the five base-3 digits by constant divisions (no loop, no branch), then ours */
        int v = packed[b * 26 + j / 5];
        int d0 = v % 3, d1 = (v / 3) % 3, d2 = (v / 9) % 3, d3 = (v / 27) % 3, d4 = v / 81;
        int code = digit == 0 ? d0 : digit == 1 ? d1 : digit == 2 ? d2 : digit == 3 ? d3 : d4;
        float s = scales[b];
        float v32 = code == 0 ? 0.0f : (code == 1 ? s : -s);
        out[i] = accumulate ? __fadd_rn(out[i], v32) : v32;
    }
}

/* fp16 and bf16: float32 values (divided by `scale` when `divide`) to 16-bit codes, and
   back (times `scale` when `multiply`, written or added). A thread takes four values at
   a time (one 16-byte load) when `vector` says both arrays are aligned for it, then the
   tail one at a time. The conversions are gpukv_f2h / gpukv_f2b (kernels.py's). */
__device__ __forceinline__ unsigned short gpukv_encode16(float v, float scale, int divide,
                                                         int bf) {
    if (divide) v = __fdiv_rn(v, scale);
    return bf ? gpukv_f2b(v) : gpukv_f2h(v);
}

__device__ __forceinline__ float gpukv_decode16(unsigned short h, float scale, int multiply,
                                                int bf) {
    float v = bf ? gpukv_b2f(h) : gpukv_h2f(h);
    return multiply ? __fmul_rn(v, scale) : v;
}

__device__ __forceinline__ void gpukv_cast16(
        const float* __restrict__ x, unsigned short* __restrict__ out, long long n,
        float scale, int divide, int vector, int bf) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long quads = vector ? n >> 2 : 0;
    for (long long q = first; q < quads; q += stride) {
        float4 v = ((const float4*)x)[q];
        ushort4 h;
        h.x = gpukv_encode16(v.x, scale, divide, bf);
        h.y = gpukv_encode16(v.y, scale, divide, bf);
        h.z = gpukv_encode16(v.z, scale, divide, bf);
        h.w = gpukv_encode16(v.w, scale, divide, bf);
        ((ushort4*)out)[q] = h;
    }
    for (long long i = 4 * quads + first; i < n; i += stride)
        out[i] = gpukv_encode16(x[i], scale, divide, bf);
}

__device__ __forceinline__ void gpukv_uncast16(
        const unsigned short* __restrict__ in, float* __restrict__ out, long long n,
        float scale, int multiply, int accumulate, int vector, int bf) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long quads = vector ? n >> 2 : 0;
    for (long long q = first; q < quads; q += stride) {
        ushort4 h = ((const ushort4*)in)[q];
        float4 v;
        v.x = gpukv_decode16(h.x, scale, multiply, bf);
        v.y = gpukv_decode16(h.y, scale, multiply, bf);
        v.z = gpukv_decode16(h.z, scale, multiply, bf);
        v.w = gpukv_decode16(h.w, scale, multiply, bf);
        if (accumulate) {
            float4 o = ((const float4*)out)[q];
            v.x = __fadd_rn(o.x, v.x);
            v.y = __fadd_rn(o.y, v.y);
            v.z = __fadd_rn(o.z, v.z);
            v.w = __fadd_rn(o.w, v.w);
        }
        ((float4*)out)[q] = v;
    }
    for (long long i = 4 * quads + first; i < n; i += stride) {
        float v = gpukv_decode16(in[i], scale, multiply, bf);
        out[i] = accumulate ? __fadd_rn(out[i], v) : v;
    }
}

extern "C" __global__ void gpukv_cast_fp16(
        const float* __restrict__ x, unsigned short* __restrict__ out, long long n,
        float scale, int divide, int vector) {
    gpukv_cast16(x, out, n, scale, divide, vector, 0);
}

extern "C" __global__ void gpukv_cast_bf16(
        const float* __restrict__ x, unsigned short* __restrict__ out, long long n,
        float scale, int divide, int vector) {
    gpukv_cast16(x, out, n, scale, divide, vector, 1);
}

extern "C" __global__ void gpukv_uncast_fp16(
        const unsigned short* __restrict__ in, float* __restrict__ out, long long n,
        float scale, int multiply, int accumulate, int vector) {
    gpukv_uncast16(in, out, n, scale, multiply, accumulate, vector, 0);
}

extern "C" __global__ void gpukv_uncast_bf16(
        const unsigned short* __restrict__ in, float* __restrict__ out, long long n,
        float scale, int multiply, int accumulate, int vector) {
    gpukv_uncast16(in, out, n, scale, multiply, accumulate, vector, 1);
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
