// floor-step and floor-step+ack, rows of `tandem bench proxy --workloads
// floor` (issue 23): the physical floor of the proxy's own structure. The
// proxy no longer sends per token: per decode step it is woken by the
// decoder's one record, reads it, then writes ONE send per client
// connection carrying that connection's streams' token messages. The
// floor server (`tandem bench proxy-floor-server --mode step|step-ack`, in
// its own process, one thread) does exactly that and nothing else:
//   - a feeder thread in the bench process plays the decoder: one small
//     message per step on a loopback TCP connection at the floor's cadence;
//   - the server sleeps in recv() on that connection, reads the message,
//     then sends, per client connection (4, as the gRPC client's channels),
//     one buffer holding one token message (protobuf + 5-byte gRPC prefix
//     + 9-byte HTTP/2 DATA header, floor-tcp's size) per stream of that
//     connection (stream i on connection i % 4; 16 streams, as `stream`);
//   - one reader thread in the bench process sleeps in epoll_wait over the
//     client connections between steps, as floor-tcp's reader;
//   - step-ack: the reader sends a 13-byte ack (a WINDOW_UPDATE's size)
//     after each read, and the server reads each connection's acks once per
//     step (recv, MSG_DONTWAIT) before writing to it, as an HTTP/2 server
//     must read its clients' WINDOW_UPDATEs.
// Only the server's CPU is charged (the feeder's is the decoder's side).
// Docs: docs/bench-serve.md, "The floor workload".
#pragma once

#include <cstdint>
#include <string>

#include "cli/bench_proxy_floor.h"
#include "common/status.h"

namespace tandem::cli {

// The server's side, after `listen_fd` (127.0.0.1) is announced: accepts the
// feeder (and tells it so with one byte), then `connections` clients; serves
// `messages` token messages of `bytes`, `streams` per step; then shuts the
// client connections down for writing and waits to be killed. 0 on success.
int ServeStepFloor(int listen_fd, uint32_t connections, uint32_t streams, uint64_t messages,
                   uint32_t bytes, bool ack);

// The bench's side: spawns the server, feeds it, reads every token; a row
// named floor-step (ack: floor-step+ack). `reader_per_connection`: each
// client connection has a reader thread of its own, so that each of the
// server's sends per step wakes a thread of its own (the loopback charges
// that wake-up to the sender), nearer the load generator's gRPC client
// (two polling threads that wake ~7 times per step between them) than one
// reader for all: floor-4r, +ack with acks (the floor workload runs
// floor-4r+ack only).
Result<FloorRow> RunStepFloor(const std::string& self, const FloorSpec& spec, bool ack,
                              bool reader_per_connection);

}  // namespace tandem::cli
