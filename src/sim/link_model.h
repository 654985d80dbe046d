// The links between the simulated GPUs of one worker (issue 18,
// docs/sim.md "Tensor and pipeline parallelism"): four link classes with
// published bandwidth and per-hop latency, the ring all-reduce and
// all-gather times over a group of ranks that may span nodes, and the
// pipeline formula. Pure functions of plain values.
//
// Thread-safety: the table is immutable; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::sim {

enum class LinkClass { kNvlink, kPcie, kRdma, kEthernet };

struct LinkSpec {
  LinkClass cls = LinkClass::kNvlink;
  std::string name;          // "nvlink"
  double bytes_per_s = 0;    // one direction, per GPU
  double hop_latency_s = 0;  // one ring step (message latency)
  std::string source;        // where the numbers come from
};

const LinkSpec& LinkSpecFor(LinkClass cls);
// "nvlink" | "pcie" | "rdma" | "ethernet" (case-insensitive); INVALID_ARGUMENT
// naming `what` and the known names otherwise.
Result<LinkClass> ParseLinkClass(std::string_view name, std::string_view what);
std::string LinkClassNames();  // "nvlink, pcie, rdma, ethernet"

// Ring all-reduce of `bytes` over `ranks` ranks on `nodes` nodes (ranks
// spread evenly, each node's ranks consecutive in the ring):
//   2 (ranks - nodes) · intra.hop_latency + 2 (nodes - 1) · inter.hop_latency
//   + 2 (ranks - 1) / ranks · bytes / bandwidth,
// the bandwidth being the inter-node link's when nodes > 1 (the ring's
// slowest link; every GPU has its own NIC) and the intra-node link's
// otherwise. 0 for one rank.
double RingAllReduceSeconds(double bytes, uint32_t ranks, uint32_t nodes, const LinkSpec& intra,
                            const LinkSpec& inter);
// Ring all-gather of `bytes` in all (each rank contributes bytes / ranks):
// half the steps of the all-reduce: (ranks - nodes) · intra latency +
// (nodes - 1) · inter latency + (ranks - 1) / ranks · bytes / bandwidth.
double RingAllGatherSeconds(double bytes, uint32_t ranks, uint32_t nodes, const LinkSpec& intra,
                            const LinkSpec& inter);
// One point-to-point send: latency + bytes / bandwidth.
double SendSeconds(double bytes, const LinkSpec& link);
// m micro-batches through pp stages from an empty pipeline, each stage
// slot lasting `slot_s`: (m + pp - 1) · slot_s (fill and drain: the
// pipeline bubble is (pp - 1) slots).
double PipelineSeconds(double slot_s, uint32_t microbatches, uint32_t pp);

// Where the ranks of a worker sit: rank r on node r / gpus_per_node.
// Nodes spanned by ranks [first, first + count).
uint32_t NodesSpanned(uint32_t first_rank, uint32_t count, uint32_t gpus_per_node);

}  // namespace tandem::sim
