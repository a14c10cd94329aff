/* Open MPI baseline for tools/bench/compare_mpi.sh: times MPI_Allreduce, MPI_Allgather,
 * MPI_Reduce_scatter_block, MPI_Bcast (root 0) or MPI_Alltoall on float data the way tutti-perf times NCCL calls (warm-up, then the
 * average of -n back-to-back calls, averaged over ranks), for the same sizes (nccl-tests' size:
 * the larger buffer). Output: "size_bytes time_us" per line.
 *
 *   mpirun -np N mpi_bench all_reduce|all_gather|reduce_scatter|broadcast|alltoall MIN MAX FACTOR ITERS WARMUP */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 7) {
    if (rank == 0) fprintf(stderr, "usage: mpi_bench COLL MIN MAX FACTOR ITERS WARMUP\n");
    MPI_Finalize();
    return 2;
  }
  const char* coll = argv[1];
  long min = atol(argv[2]), max = atol(argv[3]);
  int factor = atoi(argv[4]), iters = atoi(argv[5]), warmup = atoi(argv[6]);
  int kind = strcmp(coll, "all_reduce") == 0       ? 0
             : strcmp(coll, "all_gather") == 0     ? 1
             : strcmp(coll, "reduce_scatter") == 0 ? 2
             : strcmp(coll, "broadcast") == 0      ? 3
             : strcmp(coll, "alltoall") == 0       ? 4
                                                   : -1;
  if (kind < 0) {
    if (rank == 0) fprintf(stderr, "mpi_bench: unknown collective %s\n", coll);
    MPI_Finalize();
    return 2;
  }
  float* a = malloc((size_t)max + 64);
  float* b = malloc((size_t)max + 64);
  memset(a, 0, (size_t)max);
  memset(b, 0, (size_t)max);
  int* counts = malloc(sizeof(int) * n);
  for (long bytes = min; bytes <= max; bytes *= factor) {
    long elems = bytes / 4;
    /* nccl-tests' count: the whole buffer for all-reduce and broadcast, a rank's piece otherwise */
    long per = kind == 0 || kind == 3 ? elems : elems / n;
    if (per < 1) per = 1;
    for (int i = 0; i < warmup + iters; ++i) {
      if (i == warmup) MPI_Barrier(MPI_COMM_WORLD);
      double t0 = i == warmup ? MPI_Wtime() : 0;
      static double start;
      if (i == warmup) start = t0;
      if (kind == 0) MPI_Allreduce(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (kind == 1) MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      else if (kind == 2) MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (kind == 3) MPI_Bcast(a, (int)per, MPI_FLOAT, 0, MPI_COMM_WORLD);
      else MPI_Alltoall(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      if (i == warmup + iters - 1) {
        double t = (MPI_Wtime() - start) / iters * 1e6, sum;
        MPI_Reduce(&t, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) printf("%ld %.2f\n", bytes, sum / n);
      }
    }
    if (bytes >= max) break;
  }
  free(a);
  free(b);
  free(counts);
  MPI_Finalize();
  return 0;
}
