// RPC edge shared by the decoder and prefiller services: worker.proto's
// EngineParams as the engine's SamplingParams.
#pragma once

#include "engine/sampler.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::worker {

engine::SamplingParams ToSampling(const tandem::v1::EngineParams& p);

}  // namespace tandem::worker
