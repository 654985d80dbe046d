#include "common/status.h"

namespace tandem {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  return Status(code_, std::move(msg));
}

#define TANDEM_DEFINE_ERROR_(fn, code) \
  Status fn(std::string message) { return Status(StatusCode::code, std::move(message)); }
TANDEM_DEFINE_ERROR_(InvalidArgumentError, kInvalidArgument)
TANDEM_DEFINE_ERROR_(NotFoundError, kNotFound)
TANDEM_DEFINE_ERROR_(AlreadyExistsError, kAlreadyExists)
TANDEM_DEFINE_ERROR_(ResourceExhaustedError, kResourceExhausted)
TANDEM_DEFINE_ERROR_(FailedPreconditionError, kFailedPrecondition)
TANDEM_DEFINE_ERROR_(OutOfRangeError, kOutOfRange)
TANDEM_DEFINE_ERROR_(UnimplementedError, kUnimplemented)
TANDEM_DEFINE_ERROR_(InternalError, kInternal)
TANDEM_DEFINE_ERROR_(UnavailableError, kUnavailable)
TANDEM_DEFINE_ERROR_(DeadlineExceededError, kDeadlineExceeded)
TANDEM_DEFINE_ERROR_(CancelledError, kCancelled)
TANDEM_DEFINE_ERROR_(AbortedError, kAborted)
TANDEM_DEFINE_ERROR_(DataLossError, kDataLoss)
TANDEM_DEFINE_ERROR_(UnauthenticatedError, kUnauthenticated)
TANDEM_DEFINE_ERROR_(PermissionDeniedError, kPermissionDenied)
#undef TANDEM_DEFINE_ERROR_

}  // namespace tandem
