// The TMA gather: Hopper bulk copies global -> shared -> global (docs/design.md §6.6).
//
// One thread per block drives a DWDP_STAGES-deep ring of DWDP_CHUNK-byte shared-memory
// stages: cp.async.bulk loads a chunk into a stage and completes on the stage's
// mbarrier (expect_tx bytes); a bulk store (bulk_group) writes the stage out; a stage is
// loaded again once its store has finished reading it (wait_group.read). The chunk bytes that are not whole 16-byte units
// (and whole chunks of unaligned descriptors) are copied first by every thread of the
// block with plain loads and stores; they are disjoint from the bulk bytes.
//
// Launch: grid = the SM reserve, block = DWDP_THREADS threads, dynamic shared memory =
// DWDP_STAGES * DWDP_CHUNK + 8 * DWDP_STAGES bytes (the loader raises the function's
// limit). Needs sm_90 or newer. Parameters as the register gather.
#ifndef DWDP_THREADS
#define DWDP_THREADS 128
#endif
#ifndef DWDP_STAGES
#define DWDP_STAGES 4
#endif
#ifndef DWDP_CHUNK
#define DWDP_CHUNK 49152
#endif
// Stores that may still be reading shared memory when a stage is loaded again: the
// stage of tile i - DWDP_STORE_LAG is reloaded at tile i, so DWDP_STAGES - DWDP_STORE_LAG
// loads and up to DWDP_STORE_LAG stores are in flight.
#ifndef DWDP_STORE_LAG
#define DWDP_STORE_LAG 1
#endif
#if DWDP_STORE_LAG < 1 || DWDP_STORE_LAG >= DWDP_STAGES
#error "DWDP_STORE_LAG must be in [1, DWDP_STAGES - 1]"
#endif
// DWDP_EVICT_FIRST=1: bulk loads and stores carry an L2 evict-first cache policy (each
// byte is touched once).
#ifndef DWDP_EVICT_FIRST
#define DWDP_EVICT_FIRST 0
#endif
#define DWDP_STR2(x) #x
#define DWDP_STR(x) DWDP_STR2(x)

#include "gather_common.cuh"

__device__ __forceinline__ u32 dwdp_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void dwdp_bar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

__device__ __forceinline__ bool dwdp_bar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}

__device__ __forceinline__ u64 dwdp_evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

__device__ __forceinline__ void dwdp_load_tile(u32 stage, u32 bar, const void* src, u32 len,
                                               u64 policy) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(len)
                 : "memory");
#if DWDP_EVICT_FIRST
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;"
        ::"r"(stage), "l"(src), "r"(len), "r"(bar), "l"(policy)
        : "memory");
#else
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(stage), "l"(src), "r"(len), "r"(bar)
        : "memory");
#endif
}

__device__ __forceinline__ void dwdp_store_tile(void* dst, u32 stage, u32 len, u64 policy) {
#if DWDP_EVICT_FIRST
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                 ::"l"(dst), "r"(stage), "r"(len), "l"(policy)
                 : "memory");
#else
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(stage), "r"(len)
                 : "memory");
#endif
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Walks the bulk (16-byte) parts of one block's chunks in order.
struct TileCursor {
    u64 c;
    int d;
};

__device__ __forceinline__ bool dwdp_next_tile(const GatherDesc* __restrict__ table, int n_desc,
                                               u64 total_chunks, unsigned char* dst_base,
                                               TileCursor& cur, Chunk& out) {
    while (cur.c < total_chunks) {
        cur.d = dwdp_find_desc(table, n_desc, cur.d, cur.c);
        out = dwdp_chunk(table, cur.d, cur.c, dst_base);
        cur.c += gridDim.x;
        if (out.vec_len > 0) {
            return true;
        }
    }
    return false;
}

extern "C" __global__ void __launch_bounds__(DWDP_THREADS)
dwdp_gather_tma(const GatherDesc* __restrict__ table, int n_desc, u64 total_chunks,
                unsigned char* dst_base) {
    extern __shared__ __align__(128) unsigned char smem[];

    // Pass 1, every thread: the bytes that do not go in 16-byte units.
    {
        int d = 0;
        for (u64 c = blockIdx.x; c < total_chunks; c += gridDim.x) {
            d = dwdp_find_desc(table, n_desc, d, c);
            dwdp_copy_scalar_tail(dwdp_chunk(table, d, c, dst_base));
        }
    }
    if (threadIdx.x != 0) {
        return;
    }

    // Pass 2, one thread: the bulk pipeline.
    const u32 stage0 = dwdp_smem(smem);
    const u32 bar0 = dwdp_smem(smem + (u64)DWDP_STAGES * DWDP_CHUNK);
#pragma unroll
    for (int s = 0; s < DWDP_STAGES; ++s) {
        dwdp_bar_init(bar0 + 8 * s);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const u64 policy = DWDP_EVICT_FIRST ? dwdp_evict_first_policy() : 0ull;

    unsigned char* stage_dst[DWDP_STAGES];
    u32 stage_len[DWDP_STAGES];
    TileCursor cur;
    cur.c = blockIdx.x;
    cur.d = 0;
    Chunk k;
    u32 issued = 0;
    while (issued < DWDP_STAGES &&
           dwdp_next_tile(table, n_desc, total_chunks, dst_base, cur, k)) {
        const u32 s = issued % DWDP_STAGES;
        dwdp_load_tile(stage0 + s * DWDP_CHUNK, bar0 + 8 * s, k.src, (u32)k.vec_len, policy);
        stage_dst[s] = k.dst;
        stage_len[s] = (u32)k.vec_len;
        ++issued;
    }
    for (u32 done = 0; done < issued; ++done) {
        const u32 s = done % DWDP_STAGES;
        while (!dwdp_bar_try_wait(bar0 + 8 * s, (done / DWDP_STAGES) & 1u)) {
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        dwdp_store_tile(stage_dst[s], stage0 + s * DWDP_CHUNK, stage_len[s], policy);
        // The stage of tile done - LAG is free once its store has read it (at most LAG
        // newer stores pending); load the next tile there (its index, issued, has that
        // stage: issued == done - LAG + STAGES).
        if (done >= DWDP_STORE_LAG &&
            dwdp_next_tile(table, n_desc, total_chunks, dst_base, cur, k)) {
            const u32 p = (done - DWDP_STORE_LAG) % DWDP_STAGES;
            asm volatile("cp.async.bulk.wait_group.read " DWDP_STR(DWDP_STORE_LAG) ";" ::: "memory");
            dwdp_load_tile(stage0 + p * DWDP_CHUNK, bar0 + 8 * p, k.src, (u32)k.vec_len, policy);
            stage_dst[p] = k.dst;
            stage_len[p] = (u32)k.vec_len;
            ++issued;
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
