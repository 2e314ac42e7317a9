// A product C = A·B on AMX tiles with the engine's 16 × 48 block (one A tile, three B tiles)
// against a 32 × 32 block (two A tiles, two B tiles), at shapes of the main job's step; operands
// pre-packed, C stored (docs/PERF.md, 2026-11-27, fourth session; "nostore" leaves C in tiles).
//   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f scripts/amx/blocks.c -o /tmp/blocks && /tmp/blocks
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
// A packed: row-tile panels [mt][K/2 pairs][16 rows]?? use layout: panel ip: 16 rows x KP pairs (row stride KP*4)
// B packed (1x3 layout): panels of 48 cols: [KP][48] words. (2x2 layout): panels of 32 cols: [KP][32] words.
int M=128,N=384,K=384;
uint32_t *A,*B3,*B2; float *C;
void k13(){ int KP=K/2; for(int j0=0;j0<N;j0+=48){ uint32_t*pb=B3+(size_t)(j0/48)*KP*48; for(int i=0;i<M;i+=16){ uint32_t*pa=A+(size_t)(i/16)*16*KP;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);
  for(int p=0;p<KP;p+=16){ _tile_loadd(3,pa+p,KP*4); _tile_loadd(4,pb+p*48,192);_tile_dpbf16ps(0,3,4);_tile_loadd(5,pb+p*48+16,192);_tile_dpbf16ps(1,3,5);_tile_loadd(6,pb+p*48+32,192);_tile_dpbf16ps(2,3,6);}
  float*c=C+(size_t)i*N+j0; _tile_stored(0,c,N*4);_tile_stored(1,c+16,N*4);_tile_stored(2,c+32,N*4);}}}
// 2x2, loop order: i-block (32 rows) outer, j inner
void k22(){ int KP=K/2; for(int i=0;i<M;i+=32){ uint32_t*pa0=A+(size_t)(i/16)*16*KP, *pa1=pa0+16*KP; for(int j0=0;j0<N;j0+=32){ uint32_t*pb=B2+(size_t)(j0/32)*KP*32;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for(int p=0;p<KP;p+=16){ _tile_loadd(4,pa0+p,KP*4); _tile_loadd(6,pb+p*32,128); _tile_dpbf16ps(0,4,6); _tile_loadd(7,pb+p*32+16,128); _tile_dpbf16ps(1,4,7);
     _tile_loadd(5,pa1+p,KP*4); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
  float*c=C+(size_t)i*N+j0; _tile_stored(0,c,N*4);_tile_stored(1,c+16,N*4);_tile_stored(2,c+16*N,N*4);_tile_stored(3,c+16*N+16,N*4);}}}
// 2x2, j outer, i inner
void k22j(){ int KP=K/2; for(int j0=0;j0<N;j0+=32){ uint32_t*pb=B2+(size_t)(j0/32)*KP*32; for(int i=0;i<M;i+=32){ uint32_t*pa0=A+(size_t)(i/16)*16*KP, *pa1=pa0+16*KP;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for(int p=0;p<KP;p+=16){ _tile_loadd(4,pa0+p,KP*4); _tile_loadd(6,pb+p*32,128); _tile_dpbf16ps(0,4,6); _tile_loadd(7,pb+p*32+16,128); _tile_dpbf16ps(1,4,7);
     _tile_loadd(5,pa1+p,KP*4); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
  float*c=C+(size_t)i*N+j0; _tile_stored(0,c,N*4);_tile_stored(1,c+16,N*4);_tile_stored(2,c+16*N,N*4);_tile_stored(3,c+16*N+16,N*4);}}}
void knostore(){ int KP=K/2; for(int i=0;i<M;i+=32){ uint32_t*pa0=A+(size_t)(i/16)*16*KP, *pa1=pa0+16*KP; for(int j0=0;j0<N;j0+=32){ uint32_t*pb=B2+(size_t)(j0/32)*KP*32;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for(int p=0;p<KP;p+=16){ _tile_loadd(4,pa0+p,KP*4); _tile_loadd(6,pb+p*32,128); _tile_dpbf16ps(0,4,6); _tile_loadd(7,pb+p*32+16,128); _tile_dpbf16ps(1,4,7);
     _tile_loadd(5,pa1+p,KP*4); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
  }}}
int main(int argc,char**argv){
  if(syscall(SYS_arch_prctl,0x1023,18)){printf("no perm\n");return 1;}
  cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  _tile_loadconfig(&c);
  int shapes[][3]={{1536,384,960},{1536,384,128},{128,384,384},{128,1536,384}};
  for(int s=0;s<4;s++){ M=shapes[s][0];N=shapes[s][1];K=shapes[s][2];
  A=aligned_alloc(64,M*K*2); B3=aligned_alloc(64,K*N*2); B2=aligned_alloc(64,K*N*2); C=aligned_alloc(64,M*N*4);
  for(int i=0;i<M*K/2;i++)A[i]=0x3f803f80; for(int i=0;i<K*N/2;i++){B3[i]=0x3f803f80;B2[i]=0x3f803f80;} memset(C,0,M*N*4);
  void (*fs[])(void)={k13,k22,k22j,knostore}; const char*nm[]={"1x3 j-outer","2x2 i-outer","2x2 j-outer","2x2 nostore"};
  double fl=2.0*M*N*K;
  for(int f=0;f<4;f++){ for(int r=0;r<100;r++)fs[f](); int n=3000; double t=now(); for(int r=0;r<n;r++)fs[f](); t=(now()-t)/n;
    printf("%dx%dx%d %-12s %6.1f us %5.0f GF/s\n",M,N,K,nm[f],t*1e6,fl/t/1e9);}
  free(A);free(B3);free(B2);free(C);}
  return 0;}
