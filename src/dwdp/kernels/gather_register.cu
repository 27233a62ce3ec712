// The register gather: every thread moves 16-byte vectors through registers, with
// DWDP_UNROLL independent loads in flight before the first store (docs/design.md §6.6).
//
// Launch: grid = the SM reserve (resident blocks), block = DWDP_THREADS threads, no
// shared memory. Parameters: (const GatherDesc* table, int n_desc, u64 total_chunks,
// unsigned char* dst_base). See gather_common.cuh for the table and the chunking.
#ifndef DWDP_THREADS
#define DWDP_THREADS 512
#endif
#ifndef DWDP_UNROLL
#define DWDP_UNROLL 8
#endif
#ifndef DWDP_CHUNK
#define DWDP_CHUNK (DWDP_THREADS * 16 * DWDP_UNROLL)
#endif

#include "gather_common.cuh"

// Sources are read-only during a gather: the non-coherent path, and no L1 allocation
// since every byte is read once. DWDP_L2_PREFETCH=1 adds the L2::256B prefetch hint
// (DRAM is read in whole 256-byte sectors groups).
#ifndef DWDP_L2_PREFETCH
#define DWDP_L2_PREFETCH 0
#endif
__device__ __forceinline__ int4 dwdp_load16(const int4* p) {
    int4 v;
#if DWDP_L2_PREFETCH
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
    return v;
}

// DWDP_STORE_CS=1: streaming (evict-first) stores, since this kernel never reads the
// destination again; 0: plain stores.
#ifndef DWDP_STORE_CS
#define DWDP_STORE_CS 0
#endif
__device__ __forceinline__ void dwdp_store16(int4* p, const int4& v) {
#if DWDP_STORE_CS
    asm volatile("st.global.cs.v4.s32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
#else
    *p = v;
#endif
}

extern "C" __global__ void __launch_bounds__(DWDP_THREADS)
dwdp_gather_register(const GatherDesc* __restrict__ table, int n_desc, u64 total_chunks,
                     unsigned char* dst_base) {
    constexpr u64 kStep = (u64)DWDP_THREADS * DWDP_UNROLL;  // 16-byte units per round
    int d = 0;
    for (u64 c = blockIdx.x; c < total_chunks; c += gridDim.x) {
        d = dwdp_find_desc(table, n_desc, d, c);
        const Chunk k = dwdp_chunk(table, d, c, dst_base);
        const int4* s4 = reinterpret_cast<const int4*>(k.src);
        int4* t4 = reinterpret_cast<int4*>(k.dst);
        const u64 n4 = k.vec_len >> 4;
        for (u64 base = threadIdx.x; base < n4; base += kStep) {
            int4 r[DWDP_UNROLL];
#pragma unroll
            for (int u = 0; u < DWDP_UNROLL; ++u) {
                const u64 i = base + (u64)u * DWDP_THREADS;
                if (i < n4) {
                    r[u] = dwdp_load16(s4 + i);
                }
            }
#pragma unroll
            for (int u = 0; u < DWDP_UNROLL; ++u) {
                const u64 i = base + (u64)u * DWDP_THREADS;
                if (i < n4) {
                    dwdp_store16(t4 + i, r[u]);
                }
            }
        }
        dwdp_copy_scalar_tail(k);
    }
}
