// Who exported a KV descriptor, precisely enough to tell, on the same host,
// a peer process that is stopped (alive) from one that is gone
// (docs/kvtransfer.md, "Connection handshake"). Linux /proc only; anything
// that cannot be read leaves the identity unknown, and an unknown identity
// is never treated as local. Pure functions; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::kvtransfer {

struct ProcessIdentity {
  uint32_t pid = 0;                // in the exporter's pid namespace; 0 = unknown
  uint64_t start_time_ticks = 0;   // field 22 of /proc/PID/stat (clock ticks after boot)
  uint64_t pid_namespace = 0;      // inode of /proc/self/ns/pid
  std::string boot_id;             // /proc/sys/kernel/random/boot_id (a UUID, 36 chars)

  bool known() const { return pid != 0 && pid_namespace != 0 && !boot_id.empty(); }
  // Same kernel boot and same pid namespace as `self`: `pid` names the same
  // process table entry here as at the exporter.
  bool SameHostAndNamespace(const ProcessIdentity& self) const {
    return known() && self.known() && boot_id == self.boot_id &&
           pid_namespace == self.pid_namespace;
  }
  bool operator==(const ProcessIdentity&) const = default;
};

// The longest boot id a descriptor may carry (a UUID is 36 characters).
inline constexpr size_t kMaxBootIdBytes = 64;

// This process's identity, read once and cached. Unknown (pid 0) when /proc
// is missing or belongs to another pid namespace than this process (then a
// pid read from it would name someone else).
const ProcessIdentity& LocalProcessIdentity();

enum class Liveness {
  kAlive,      // /proc/PID/stat exists with the same start time and is not a zombie
  kExited,     // no such pid, or a zombie (killed, not yet reaped)
  kPidReused,  // the pid belongs to a process started at another time
  kUnknown,    // /proc could not be read for another reason
};

// One read of /proc/PID/stat. Meaningful only for an identity that is
// SameHostAndNamespace as LocalProcessIdentity().
Liveness CheckLiveness(const ProcessIdentity& peer);

// Fault injection only (KvFaultOptions::stop_peer_at_import): sends SIGSTOP
// to another process on this host and waits, at most a second, until /proc
// shows it stopped. FAILED_PRECONDITION for a peer that is not another
// local process.
Status StopLocalProcess(const ProcessIdentity& peer);

// Parses the content of a /proc/PID/stat file: its state (field 3) and start
// time (field 22). The command name (field 2) may hold spaces and ')'.
// False when the text does not have that shape.
bool ParseProcStat(std::string_view stat, char* state, uint64_t* start_time_ticks,
                   uint32_t* pid = nullptr);

}  // namespace tandem::kvtransfer
