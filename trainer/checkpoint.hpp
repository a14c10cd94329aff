#pragma once
// Sharded checkpoints that load under another layout.
//
// A checkpoint is a directory:
//   manifest.json      what was trained and how: model, layout, optimizer settings, step, seed,
//                      batch, data source, and every rank file with its size and CRC-32
//   rank_NNNNN.bin     one per world rank that holds optimizer state nobody else holds (without ZeRO
//                      the dp ranks hold the same: only dp rank 0 writes): "TCKP", version, world
//                      rank, count, then `count` parameters, AdamW first moments, second moments, in
//                      the order of ParamLayout::optimizer_ranges
// Every rank writes its file; world rank 0 writes the manifest once all are written, so a directory
// with a manifest is complete. Loading, each rank reads the files it needs, rebuilds the whole
// tensors through the saved layout's maps, and keeps its shard of the new layout. Data and the
// schedule resume from the step (trainer/data.hpp cuts batches as a function of the step).
//
// Errors name the file and the field: a missing or malformed manifest field, a model that differs
// from the run's, a rank file of the wrong size, a CRC that does not match (a damaged file).

#include <cstdint>
#include <string>

#include "trainer/config.hpp"
#include "trainer/trainer.hpp"
#include "tutti/tutti.hpp"

namespace tutti::train {

struct CheckpointInfo {
  ModelConfig model;
  Layout layout;
  OptimConfig optim;
  int step = 0;
  uint64_t seed = 0;
  int batch = 0;
  std::string data;  // the training data's source
};

// Collective over the world (every rank calls it; world may be null for one rank).
void save_checkpoint(const std::string& dir, Trainer& trainer, tutti::Comm* world, const CheckpointInfo& info);
// Throws InvalidArgument naming manifest.json and the field.
CheckpointInfo read_checkpoint_manifest(const std::string& dir);
// Loads into `trainer` (whatever its layout; its model must equal the checkpoint's) and sets its
// step. Every rank calls it; no communication.
CheckpointInfo load_checkpoint(const std::string& dir, Trainer& trainer);

}  // namespace tutti::train
