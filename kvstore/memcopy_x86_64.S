# The copy loops of kvstore/memcopy.py (its _CODE bytes are this file
# assembled: tests/unit/test_memcopy.py reassembles it and compares): two with
# non-temporal stores, one with ordinary (cached) stores.
#
#   as kvstore/memcopy_x86_64.S -o /tmp/m.o && objcopy -O binary -j .text /tmp/m.o /tmp/m.bin
#
# SysV x86-64 ABI, SSE2 only. Both: dst in rdi (16-byte aligned), src in rsi
# (any alignment), n in rdx; clobber rcx, rdx, rsi, rdi, xmm0-7 (all
# caller-saved); end with sfence so the streamed stores are globally visible
# before the caller (a commit, a release) goes on.
    .intel_syntax noprefix
    .text
# nt_copy_4x at +0x000: n > 0 and a multiple of 16384. Four 4 KiB pages are
# copied interleaved, one 64-byte line of each per trip, as glibc's
# large_memcpy_4x does: more DRAM pages open at once, and the prefetcher
# sees four streams.
    .globl nt_copy_4x
nt_copy_4x:
.Lnt_4x:                  # (local: a call to it needs no relocation)
2:
    mov rcx, 64           # 64 lines of 64 B per page
3:
    prefetcht0 [rsi+128]
    prefetcht0 [rsi+4096+128]
    prefetcht0 [rsi+8192+128]
    prefetcht0 [rsi+12288+128]
    movdqu xmm0, [rsi]
    movdqu xmm1, [rsi+16]
    movdqu xmm2, [rsi+32]
    movdqu xmm3, [rsi+48]
    movdqu xmm4, [rsi+4096]
    movdqu xmm5, [rsi+4096+16]
    movdqu xmm6, [rsi+4096+32]
    movdqu xmm7, [rsi+4096+48]
    movntdq [rdi], xmm0
    movntdq [rdi+16], xmm1
    movntdq [rdi+32], xmm2
    movntdq [rdi+48], xmm3
    movntdq [rdi+4096], xmm4
    movntdq [rdi+4096+16], xmm5
    movntdq [rdi+4096+32], xmm6
    movntdq [rdi+4096+48], xmm7
    movdqu xmm0, [rsi+8192]
    movdqu xmm1, [rsi+8192+16]
    movdqu xmm2, [rsi+8192+32]
    movdqu xmm3, [rsi+8192+48]
    movdqu xmm4, [rsi+12288]
    movdqu xmm5, [rsi+12288+16]
    movdqu xmm6, [rsi+12288+32]
    movdqu xmm7, [rsi+12288+48]
    movntdq [rdi+8192], xmm0
    movntdq [rdi+8192+16], xmm1
    movntdq [rdi+8192+32], xmm2
    movntdq [rdi+8192+48], xmm3
    movntdq [rdi+12288], xmm4
    movntdq [rdi+12288+16], xmm5
    movntdq [rdi+12288+32], xmm6
    movntdq [rdi+12288+48], xmm7
    add rsi, 64
    add rdi, 64
    dec rcx
    jnz 3b
    add rsi, 12288
    add rdi, 12288
    sub rdx, 16384
    jnz 2b
    sfence
    ret
# nt_copy_64 at +0x139: n > 0 and a multiple of 64 (the tail of a copy).
    .globl nt_copy_64
nt_copy_64:
.Lnt_64:
1:
    movdqu xmm0, [rsi]
    movdqu xmm1, [rsi+16]
    movdqu xmm2, [rsi+32]
    movdqu xmm3, [rsi+48]
    movntdq [rdi], xmm0
    movntdq [rdi+16], xmm1
    movntdq [rdi+32], xmm2
    movntdq [rdi+48], xmm3
    add rsi, 64
    add rdi, 64
    sub rdx, 64
    jnz 1b
    sfence
    ret
# vec_copy_64 at +0x171: n > 0 and a multiple of 64; dst 16-byte aligned.
# The same loop with ordinary stores: what glibc's vector path does, for the
# machines where its memmove takes `rep movsb` instead and that is slow
# (AMD EPYC VMs reading 64 KiB blocks out of the 4 KiB-paged shared region:
# 1.8 GB/s against 5.5 GB/s for this loop, docs/tiers.md).
    .globl vec_copy_64
vec_copy_64:
1:
    movdqu xmm0, [rsi]
    movdqu xmm1, [rsi+16]
    movdqu xmm2, [rsi+32]
    movdqu xmm3, [rsi+48]
    movdqa [rdi], xmm0
    movdqa [rdi+16], xmm1
    movdqa [rdi+32], xmm2
    movdqa [rdi+48], xmm3
    add rsi, 64
    add rdi, 64
    sub rdx, 64
    jnz 1b
    ret
# vec_copy_list: many equal pieces in one call (n_pieces in rdx > 0, nbytes in
# rcx > 0 and a multiple of 64). Piece i: nbytes from src_list[i] to
# dst_list[i] (rdi, rsi: arrays of 64-bit addresses), any alignment (movdqu
# both ways). For the vLLM connector's CPU copier: a step's 4-16 KiB pages,
# one call instead of one per page or torch index ops (docs/tiers.md).
# Clobbers r8-r11 (caller-saved) too.
    .globl vec_copy_list
vec_copy_list:
    mov r8, rdi
    mov r9, rsi
    mov r10, rdx
    mov r11, rcx
1:
    mov rdi, [r8]
    mov rsi, [r9]
    mov rdx, r11
2:
    movdqu xmm0, [rsi]
    movdqu xmm1, [rsi+16]
    movdqu xmm2, [rsi+32]
    movdqu xmm3, [rsi+48]
    movdqu [rdi], xmm0
    movdqu [rdi+16], xmm1
    movdqu [rdi+32], xmm2
    movdqu [rdi+48], xmm3
    add rsi, 64
    add rdi, 64
    sub rdx, 64
    jnz 2b
    add r8, 8
    add r9, 8
    dec r10
    jnz 1b
    ret
# nt_copy_pieces: many pieces of any lengths in one call (pieces in rdi: an
# array of count (rsi > 0) triples of 64-bit words dst, src, n; each dst
# 16-byte aligned, n > 0 and a multiple of 64): each piece as nt_copy_4x over
# its whole 16 KiB chunks, then nt_copy_64 over the lines left. A step's
# scattered 64 KiB blocks are then one call, not one each (a call from Python
# costs ~3.5 us, a third of a 64 KiB copy: docs/tiers.md). Clobbers r8-r10
# (caller-saved) too.
    .globl nt_copy_pieces
nt_copy_pieces:
    mov r8, rdi
    mov r9, rsi
1:
    mov rdi, [r8]
    mov rsi, [r8+8]
    mov r10, [r8+16]
    mov rdx, r10
    and rdx, -16384
    jz 2f
    call .Lnt_4x          # leaves rdi, rsi past the chunks
2:
    mov rdx, r10
    and rdx, 16383
    jz 3f
    call .Lnt_64
3:
    add r8, 24
    dec r9
    jnz 1b
    ret
