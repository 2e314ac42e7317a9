// AMX tile throughput on this CPU: tdpbf16ps alone, with tile loads from L1 and L2, and C tile
// stores and loads (docs/PERF.md, 2026-11-27, fourth session). Cycles are counted at a 2.6 GHz
// clock from wall time.
//   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f scripts/amx/tiles.c -o /tmp/tiles && /tmp/tiles
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start; uint8_t r0[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((aligned(64))) cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  if(syscall(SYS_arch_prctl,0x1023,18)){printf("no perm\n");return 1;}
  cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  _tile_loadconfig(&c);
  size_t big=64<<20; uint32_t *buf=aligned_alloc(64,big); for(size_t i=0;i<big/4;i++) buf[i]=0x3f803f80;
  float *cb=aligned_alloc(64,16<<20); memset(cb,0,16<<20);
  const double GHZ=2.6;
  long N=2000000; double t;
  // A: pure tdp, 4 independent C
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);_tile_loadd(4,buf,64);_tile_loadd(5,buf,64);
  t=now(); for(long i=0;i<N;i++){_tile_dpbf16ps(0,4,5);_tile_dpbf16ps(1,4,5);_tile_dpbf16ps(2,4,5);_tile_dpbf16ps(3,4,5);} t=now()-t;
  printf("pure tdp: %.2f cycles/tdp, %.0f GFLOP/s\n", t*GHZ*1e9/(4.0*N), 4.0*N*16384/t/1e9);
  // B: 1A x 3B from L1 (same 4KB)
  t=now(); for(long i=0;i<N;i++){_tile_loadd(4,buf,64);_tile_loadd(5,buf+256,192);_tile_dpbf16ps(0,4,5);_tile_loadd(6,buf+272,192);_tile_dpbf16ps(1,4,6);_tile_loadd(7,buf+288,192);_tile_dpbf16ps(2,4,7);} t=now()-t;
  printf("1Ax3B L1: %.2f cycles/tdp\n", t*GHZ*1e9/(3.0*N));
  // C: 2Ax2B from L1
  t=now(); for(long i=0;i<N;i++){_tile_loadd(4,buf,64);_tile_loadd(5,buf+256,64);_tile_loadd(6,buf+512,128);_tile_loadd(7,buf+528,128);
     _tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,4,7);_tile_dpbf16ps(2,5,6);_tile_dpbf16ps(3,5,7);} t=now()-t;
  printf("2Ax2B L1: %.2f cycles/tdp\n", t*GHZ*1e9/(4.0*N));
  // D: 1Ax3B, A streaming through 256KB (L2), B from L1
  { long n=N; size_t span=(256<<10)/4; t=now(); size_t off=0; for(long i=0;i<n;i++){ _tile_loadd(4,buf+8192+off,64); off=(off+256)%span;
     _tile_loadd(5,buf,192);_tile_dpbf16ps(0,4,5);_tile_loadd(6,buf+16,192);_tile_dpbf16ps(1,4,6);_tile_loadd(7,buf+32,192);_tile_dpbf16ps(2,4,7);} t=now()-t;
  printf("1Ax3B A from L2 (contig 1KB tiles): %.2f cycles/tdp\n", t*GHZ*1e9/(3.0*n)); }
  // D2: A strided (stride 512 bytes like KC2*4) from L2
  { long n=N; size_t span=(256<<10)/4; t=now(); size_t off=0; for(long i=0;i<n;i++){ _tile_loadd(4,buf+8192+off,512); off=(off+16)%(span-2048);
     _tile_loadd(5,buf,192);_tile_dpbf16ps(0,4,5);_tile_loadd(6,buf+16,192);_tile_dpbf16ps(1,4,6);_tile_loadd(7,buf+32,192);_tile_dpbf16ps(2,4,7);} t=now()-t;
  printf("1Ax3B A strided 512 from L2: %.2f cycles/tdp\n", t*GHZ*1e9/(3.0*n)); }
  // E: B streaming from L2 (3KB per step contiguous), A from L1
  { long n=N; size_t span=(1<<20)/4; t=now(); size_t off=0; for(long i=0;i<n;i++){ _tile_loadd(4,buf,64);
     uint32_t*b=buf+8192+off; off=(off+768)%span;
     _tile_loadd(5,b,192);_tile_dpbf16ps(0,4,5);_tile_loadd(6,b+16,192);_tile_dpbf16ps(1,4,6);_tile_loadd(7,b+32,192);_tile_dpbf16ps(2,4,7);} t=now()-t;
  printf("1Ax3B B from L2 (1MB): %.2f cycles/tdp\n", t*GHZ*1e9/(3.0*n)); }
  // F: tilestored of 3 C tiles to stride 1536, rows walk 224x384 C (344KB)
  { long n=N/10; t=now(); size_t r=0,cl=0; for(long i=0;i<n;i++){ float*p=cb+r*384+cl; _tile_stored(0,p,1536);_tile_stored(1,p+16,1536);_tile_stored(2,p+32,1536);
      cl+=48; if(cl>=384){cl=0;r+=16;if(r>=224)r=0;} } t=now()-t;
  printf("store 3 C tiles (stride 1536): %.2f cycles per tile\n", t*GHZ*1e9/(3.0*n)); }
  { long n=N/10; t=now(); size_t r=0,cl=0; for(long i=0;i<n;i++){ float*p=cb+r*384+cl; _tile_loadd(0,p,1536);_tile_loadd(1,p+16,1536);_tile_loadd(2,p+32,1536);
      cl+=48; if(cl>=384){cl=0;r+=16;if(r>=224)r=0;} } t=now()-t;
  printf("load 3 C tiles (stride 1536): %.2f cycles per tile\n", t*GHZ*1e9/(3.0*n)); }
  _tile_release();
  return 0;
}
