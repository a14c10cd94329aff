/* tutti's additions to the NCCL API (libnccl.so.2): run a verified plan on a communicator's
 * buffers, on a stream, as MSCCL's mscclLoadAlgo / mscclRunAlgo run an algorithm file. This is the
 * way to run plans that NCCL's collective calls cannot name: fused compute + communication plans
 * (tutti/fused.hpp's programs) with their state buffers (parameters, optimizer moments) and
 * per-call scalars (learning rate, step, loss scale), and custom collectives, on device buffers
 * as on host buffers.
 *
 *   tuttiPlan_t plan;
 *   tuttiPlanLoad("zero_step.json", &plan);       // written by tutti-compile or tutti::save_plan
 *   void* states[] = {params, m, v, stats};       // the plan's state buffers, in its order
 *   tuttiRunPlan(plan, grads, NULL, shard, ncclFloat32, ncclSum, states, 4, scalars, nscalars, comm, stream);
 *
 * C++ programs holding a tutti::CompiledPlan pass its text: tuttiPlanParse(p.json().c_str(), &plan).
 *
 * Memory: the call's buffers are all device memory or all host memory, as every call's (see
 * nccl.h). Device buffers: the call is enqueued on `stream` and returns; the buffers and the state
 * buffers must stay valid, and unwritten by others, until the stream gets past it. Host buffers:
 * the call completes before it returns (non-blocking communicators: ncclInProgress, as their
 * collectives). Every rank of the communicator runs the same plan with the same count, in the same
 * order as its other collectives; the call may sit in a group (ncclGroupStart/End) beside them.
 * State buffers need every pair of ranks to share GPU memory (one host): across hosts the call is
 * refused, naming the plan. */
#ifndef TUTTI_NCCL_H_
#define TUTTI_NCCL_H_

#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A loaded, verified plan; shared by every communicator of the process that runs it. */
typedef struct tuttiPlan* tuttiPlan_t;

/* Reads a plan file (tutti's JSON, or MSCCL's XML for a path ending in .xml) and verifies it.
 * ncclInvalidArgument, with ncclGetLastError naming the file and what is wrong, if it cannot. The
 * kernels a plan names must be registered in the process first (tutti::fused::register_kernels()
 * for the fused operations'). */
ncclResult_t tuttiPlanLoad(const char* path, tuttiPlan_t* plan);
/* The same from a plan's JSON text (tutti::CompiledPlan::json()). */
ncclResult_t tuttiPlanParse(const char* json, tuttiPlan_t* plan);
/* The plan's name (valid while the plan is). */
ncclResult_t tuttiPlanName(tuttiPlan_t plan, const char** name);
/* Calls already enqueued keep what they need: a plan may be freed once its last call is made. */
ncclResult_t tuttiPlanFree(tuttiPlan_t plan);

/* Runs `plan` on this rank's buffers. count: elements per rank piece, as the plan's collective
 * counts them (an all-reduce's count, a reduce-scatter's recvcount, an all-gather's sendcount).
 * states: the plan's state buffers in the order its program declares them (nstates of them);
 * scalars: the values of its kernels' per-call scalars (nscalars; extra values are ignored, too
 * few are refused). ncclInvalidArgument names the plan and what is wrong: rank count, count, a
 * missing buffer, a state buffer, a datatype or a kernel the device cannot run. */
ncclResult_t tuttiRunPlan(tuttiPlan_t plan, const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclRedOp_t op, void* const* states, int nstates,
                          const double* scalars, int nscalars, ncclComm_t comm, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TUTTI_NCCL_H_ */
