/* An all-reduce through the NCCL API, as a C program written for NCCL would make it: two ranks
 * created by one thread inside a group, one grouped call per rank, the result checked. */
#include <nccl.h>
#include <stdio.h>

#define N 1024

int main(void) {
  ncclUniqueId id;
  ncclComm_t comms[2];
  float buf[2][N];
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || ncclGetUniqueId(&id) != ncclSuccess) return 1;
  ncclGroupStart();
  for (int r = 0; r < 2; ++r)
    if (ncclCommInitRank(&comms[r], 2, id, r) != ncclSuccess) return 1;
  if (ncclGroupEnd() != ncclSuccess) {
    fprintf(stderr, "init: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < N; ++i) buf[r][i] = (float)(r + 1) * (float)(i % 5);
  ncclGroupStart();
  for (int r = 0; r < 2; ++r) ncclAllReduce(buf[r], buf[r], N, ncclFloat, ncclSum, comms[r], NULL);
  if (ncclGroupEnd() != ncclSuccess) {
    fprintf(stderr, "all-reduce: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  int wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < N; ++i) wrong += buf[r][i] != 3.0f * (float)(i % 5);
  for (int r = 0; r < 2; ++r) ncclCommDestroy(comms[r]);
  printf("nccl_c_example: NCCL %d, all-reduce of %d floats on 2 ranks: %d wrong\n", version, N, wrong);
  return wrong != 0;
}
