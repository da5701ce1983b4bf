// troupe's CUDA kernels, compiled with NVRTC at first use (see mod.rs). Plain C with inline PTX for the
// f16 conversions, so that no CUDA header is needed at compile time. Element semantics equal the CPU path:
// f32 arithmetic in the same order, contraction into FMA disabled at compile time (fmad=false).

typedef unsigned long long u64;
typedef unsigned short u16;

#define GRID_STRIDE_LOOP(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

__device__ __forceinline__ float widen_bf16(u16 b) { return __uint_as_float(((unsigned int)b) << 16); }

__device__ __forceinline__ float widen_f16(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 narrow_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 narrow_bf16(float f) {
    unsigned int b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// op: 0 sum, 1 avg (accumulates like sum), 2 max, 3 min; max/min propagate NaN.
__device__ __forceinline__ float combine(float a, float b, int op) {
    if (op == 2) return (b > a || b != b) ? b : a;
    if (op == 3) return (b < a || b != b) ? b : a;
    return a + b;
}

extern "C" __global__ void reduce_f32(float* acc, const float* src, u64 n, int op) {
    GRID_STRIDE_LOOP(i, n) acc[i] = combine(acc[i], src[i], op);
}
extern "C" __global__ void reduce_bf16(float* acc, const u16* src, u64 n, int op) {
    GRID_STRIDE_LOOP(i, n) acc[i] = combine(acc[i], widen_bf16(src[i]), op);
}
extern "C" __global__ void reduce_f16(float* acc, const u16* src, u64 n, int op) {
    GRID_STRIDE_LOOP(i, n) acc[i] = combine(acc[i], widen_f16(src[i]), op);
}

extern "C" __global__ void scale_f32(float* x, u64 n, float factor) {
    GRID_STRIDE_LOOP(i, n) x[i] *= factor;
}

extern "C" __global__ void cast_f32_to_bf16(const float* src, u16* dst, u64 n) {
    GRID_STRIDE_LOOP(i, n) dst[i] = narrow_bf16(src[i]);
}
extern "C" __global__ void cast_bf16_to_f32(const u16* src, float* dst, u64 n) {
    GRID_STRIDE_LOOP(i, n) dst[i] = widen_bf16(src[i]);
}
extern "C" __global__ void cast_f32_to_f16(const float* src, u16* dst, u64 n) {
    GRID_STRIDE_LOOP(i, n) dst[i] = narrow_f16(src[i]);
}
extern "C" __global__ void cast_f16_to_f32(const u16* src, float* dst, u64 n) {
    GRID_STRIDE_LOOP(i, n) dst[i] = widen_f16(src[i]);
}

// One AdamW element, as adamw.rs documents it.
#define ADAMW_ELEMENT(i)                                                  \
    float p_ = p[i] * decay;                                              \
    float g_ = g[i];                                                      \
    float m_ = m[i] + one_minus_beta1 * (g_ - m[i]);                      \
    float v_ = v[i] * beta2 + one_minus_beta2 * g_ * g_;                  \
    float denom_ = sqrtf(v_) / bias_correction2_sqrt + eps;               \
    p_ = p_ + neg_step_size * (m_ / denom_);                              \
    p[i] = p_;                                                            \
    m[i] = m_;                                                            \
    v[i] = v_;

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, u64 n, float decay,
                                     float one_minus_beta1, float beta2, float one_minus_beta2,
                                     float neg_step_size, float bias_correction2_sqrt, float eps) {
    GRID_STRIDE_LOOP(i, n) { ADAMW_ELEMENT(i) }
}

extern "C" __global__ void adamw_f32_copy_out_bf16(float* p, const float* g, float* m, float* v, u16* out, u64 n,
                                                   float decay, float one_minus_beta1, float beta2,
                                                   float one_minus_beta2, float neg_step_size,
                                                   float bias_correction2_sqrt, float eps) {
    GRID_STRIDE_LOOP(i, n) {
        ADAMW_ELEMENT(i)
        out[i] = narrow_bf16(p_);
    }
}

// found: one int, set to 1 when any input is inf or NaN (benign race: every writer writes 1).
extern "C" __global__ void unscale_f32(float* g, u64 n, float inv_scale, int* found) {
    int local = 0;
    GRID_STRIDE_LOOP(i, n) {
        float x = g[i];
        local |= (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
        g[i] = x * inv_scale;
    }
    if (local) *found = 1;
}

// Sum of squares in two passes, deterministic for a given length (the grid size is a function of it):
// each block writes its partial (f64 accumulation, as on the CPU) to partials[blockIdx.x], then one block
// adds the partials in a fixed order. blockDim.x must be 256 (the shared arrays' size).
__device__ __forceinline__ double block_sum(double local) {
    __shared__ double partial[256];
    partial[threadIdx.x] = local;
    __syncthreads();
    for (unsigned int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    return partial[0];
}

extern "C" __global__ void sum_of_squares_partials_f32(const float* x, u64 n, double* partials) {
    double local = 0.0;
    GRID_STRIDE_LOOP(i, n) {
        double d = (double)x[i];
        local += d * d;
    }
    double sum = block_sum(local);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

extern "C" __global__ void sum_partials_f64(const double* partials, u64 count, double* out) {
    double local = 0.0;
    for (u64 i = threadIdx.x; i < count; i += blockDim.x) local += partials[i];
    double sum = block_sum(local);
    if (threadIdx.x == 0) *out = sum;
}
