/* A plain NCCL program: it includes NCCL's own header (from /usr/local/cuda/include), uses host
 * buffers, and links with -lnccl. Run with LD_LIBRARY_PATH=<build>/lib it must run on tutti.
 *
 *   nccl-dropin threads N     one process driving N ranks in a group (ncclCommInitAll)
 *   nccl-dropin process       one rank per process (under tutti-run or mpirun + NCCL_COMM_ID)
 */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                                    \
  do {                                                                                                 \
    ncclResult_t rc_ = (call);                                                                         \
    if (rc_ != ncclSuccess) {                                                                          \
      fprintf(stderr, "%s:%d %s failed: %s (%s)\n", __FILE__, __LINE__, #call, ncclGetErrorString(rc_), \
              ncclGetLastError(NULL));                                                                 \
      exit(1);                                                                                         \
    }                                                                                                  \
  } while (0)

enum { kCount = 1000 };

static int check_rank(ncclComm_t comm, int rank, int n) {
  float* in = malloc(kCount * sizeof(float));
  float* out = malloc(kCount * n * sizeof(float));
  int errors = 0;
  for (int i = 0; i < kCount; ++i) in[i] = (float)(rank + i % 7);
  CHECK(ncclAllReduce(in, out, kCount, ncclFloat, ncclSum, comm, 0));
  for (int i = 0; i < kCount; ++i) errors += out[i] != (float)(n * (n - 1) / 2 + n * (i % 7));
  CHECK(ncclAllGather(in, out, kCount, ncclFloat, comm, 0));
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < kCount; ++i) errors += out[r * kCount + i] != (float)(r + i % 7);
  /* Bad input is an error, not a crash. */
  if (ncclAllReduce(NULL, out, kCount, ncclFloat, ncclSum, comm, 0) != ncclInvalidArgument) ++errors;
  if (strlen(ncclGetLastError(comm)) == 0) ++errors;
  free(in);
  free(out);
  return errors;
}

int main(int argc, char** argv) {
  int version = 0;
  CHECK(ncclGetVersion(&version));
  printf("runtime NCCL version code %d (header %d)\n", version, NCCL_VERSION_CODE);
  if (argc >= 3 && strcmp(argv[1], "threads") == 0) {
    int n = atoi(argv[2]);
    ncclComm_t* comms = malloc(sizeof(ncclComm_t) * n);
    CHECK(ncclCommInitAll(comms, n, NULL));
    /* One thread drives every rank: the collective must be issued inside a group. */
    float** bufs = malloc(sizeof(float*) * n);
    for (int r = 0; r < n; ++r) {
      bufs[r] = malloc(kCount * sizeof(float));
      for (int i = 0; i < kCount; ++i) bufs[r][i] = (float)r;
    }
    CHECK(ncclGroupStart());
    for (int r = 0; r < n; ++r) CHECK(ncclAllReduce(bufs[r], bufs[r], kCount, ncclFloat, ncclSum, comms[r], 0));
    CHECK(ncclGroupEnd());
    int errors = 0;
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < kCount; ++i) errors += bufs[r][i] != (float)(n * (n - 1) / 2);
    for (int r = 0; r < n; ++r) CHECK(ncclCommDestroy(comms[r]));
    printf("%d ranks in one thread: %s\n", n, errors ? "WRONG" : "all results correct");
    return errors ? 1 : 0;
  }
  if (argc >= 2 && strcmp(argv[1], "process") == 0) {
    const char* r = getenv("TUTTI_RANK");
    const char* s = getenv("TUTTI_SIZE");
    if (!r || !s) {
      fprintf(stderr, "run under tutti-run\n");
      return 2;
    }
    int rank = atoi(r), n = atoi(s);
    ncclUniqueId id;
    CHECK(ncclGetUniqueId(&id)); /* with NCCL_COMM_ID/TUTTI_COMM_ID set, every rank gets the same id */
    ncclComm_t comm;
    CHECK(ncclCommInitRank(&comm, n, id, rank));
    int count = 0, me = -1;
    CHECK(ncclCommCount(comm, &count));
    CHECK(ncclCommUserRank(comm, &me));
    int errors = (count != n) + (me != rank) + check_rank(comm, rank, n);
    CHECK(ncclCommDestroy(comm));
    printf("rank %d of %d: %s\n", rank, n, errors ? "WRONG" : "all results correct");
    return errors ? 1 : 0;
  }
  fprintf(stderr, "usage: nccl-dropin threads N | process\n");
  return 2;
}
