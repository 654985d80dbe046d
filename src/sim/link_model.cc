#include "sim/link_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>

namespace tandem::sim {

const LinkSpec& LinkSpecFor(LinkClass cls) {
  // Bandwidth: one direction per GPU, decimal units as the specs give them.
  // Hop latency: NCCL's own cost model (src/graph/tuning.cc, hwLat, ring
  // LL128 column, µs: NVLink 1.9, PCI 2.5, NET 4.0) except Ethernet, whose
  // kernel-TCP path (NCCL's socket transport) is an estimate.
  static const std::array<LinkSpec, 4> kLinks = {{
      {LinkClass::kNvlink, "nvlink", 450e9, 1.9e-6,
       "NVIDIA H100 SXM5 datasheet: NVLink 900 GB/s per GPU (both directions) -> 450 GB/s each "
       "way; hop latency: NCCL tuning model, NVLink ring LL128 1.9 us"},
      {LinkClass::kPcie, "pcie", 64e9, 2.5e-6,
       "PCIe 5.0 x16: 32 GT/s x 16 lanes = 64 GB/s each way (H100 PCIe datasheet: 128 GB/s "
       "both directions); hop latency: NCCL tuning model, PCI ring LL128 2.5 us"},
      {LinkClass::kRdma, "rdma", 50e9, 4.0e-6,
       "400 Gb/s NDR InfiniBand / RoCE (NVIDIA ConnectX-7: 400 Gb/s per port) = 50 GB/s, one "
       "NIC per GPU as in a DGX H100; hop latency: NCCL tuning model, NET ring LL128 4.0 us"},
      {LinkClass::kEthernet, "ethernet", 12.5e9, 10e-6,
       "100 GbE (IEEE 802.3) = 12.5 GB/s, TCP without RDMA (NCCL socket transport); hop "
       "latency 10 us: an estimate of kernel-TCP one-way latency, not a datasheet figure"},
  }};
  return kLinks[static_cast<size_t>(cls)];
}

std::string LinkClassNames() { return "nvlink, pcie, rdma, ethernet"; }

Result<LinkClass> ParseLinkClass(std::string_view name, std::string_view what) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (LinkClass c : {LinkClass::kNvlink, LinkClass::kPcie, LinkClass::kRdma,
                      LinkClass::kEthernet}) {
    if (LinkSpecFor(c).name == lower) return c;
  }
  return InvalidArgumentError(
      fmt::format("{}: unknown link class '{}' (known: {})", what, name, LinkClassNames()));
}

namespace {
double Bandwidth(uint32_t nodes, const LinkSpec& intra, const LinkSpec& inter) {
  return nodes > 1 ? inter.bytes_per_s : intra.bytes_per_s;
}
}  // namespace

double RingAllReduceSeconds(double bytes, uint32_t ranks, uint32_t nodes, const LinkSpec& intra,
                            const LinkSpec& inter) {
  if (ranks <= 1) return 0.0;
  nodes = std::clamp<uint32_t>(nodes, 1, ranks);
  const double r = ranks, n = nodes;
  return 2.0 * (r - n) * intra.hop_latency_s + 2.0 * (n - 1) * inter.hop_latency_s +
         2.0 * (r - 1) / r * bytes / Bandwidth(nodes, intra, inter);
}

double RingAllGatherSeconds(double bytes, uint32_t ranks, uint32_t nodes, const LinkSpec& intra,
                            const LinkSpec& inter) {
  if (ranks <= 1) return 0.0;
  nodes = std::clamp<uint32_t>(nodes, 1, ranks);
  const double r = ranks, n = nodes;
  return (r - n) * intra.hop_latency_s + (n - 1) * inter.hop_latency_s +
         (r - 1) / r * bytes / Bandwidth(nodes, intra, inter);
}

double SendSeconds(double bytes, const LinkSpec& link) {
  return link.hop_latency_s + bytes / link.bytes_per_s;
}

double PipelineSeconds(double slot_s, uint32_t microbatches, uint32_t pp) {
  if (microbatches == 0) return 0.0;
  return (static_cast<double>(microbatches) + static_cast<double>(pp) - 1.0) * slot_s;
}

uint32_t NodesSpanned(uint32_t first_rank, uint32_t count, uint32_t gpus_per_node) {
  if (count == 0) return 0;
  const uint32_t g = std::max<uint32_t>(1, gpus_per_node);
  return (first_rank + count - 1) / g - first_rank / g + 1;
}

}  // namespace tandem::sim
