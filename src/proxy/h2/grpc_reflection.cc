#include "proxy/h2/grpc_reflection.h"

#include <fmt/format.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <set>
#include <vector>

#include "grpc/health/v1/health.pb.h"
#include "tandem/v1/generation.pb.h"

namespace tandem::proxy::h2 {
namespace {

namespace gp = ::google::protobuf;
using WFL = gp::internal::WireFormatLite;

// ServerReflectionRequest fields.
constexpr int kHost = 1, kFileByFilename = 3, kFileContainingSymbol = 4,
              kFileContainingExtension = 5, kAllExtensionNumbersOfType = 6, kListServices = 7;
// ServerReflectionResponse fields.
constexpr int kValidHost = 1, kOriginalRequest = 2, kFileDescriptorResponse = 4,
              kAllExtensionNumbersResponse = 5, kListServicesResponse = 6, kErrorResponse = 7;

// The services this front end serves (their descriptors are linked in).
std::vector<std::string> Services() {
  // Referencing the generated messages keeps their files in the pool.
  (void)tandem::v1::GenerateRequest::descriptor();
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  return {"tandem.v1.Generation", "grpc.health.v1.Health",
          "grpc.reflection.v1alpha.ServerReflection"};
}

void PutBytes(std::string& out, int field, const std::string& bytes) {
  gp::io::StringOutputStream s(&out);
  gp::io::CodedOutputStream o(&s);
  WFL::WriteBytes(field, bytes, &o);
}

void PutVarint(std::string& out, int field, uint64_t v) {
  gp::io::StringOutputStream s(&out);
  gp::io::CodedOutputStream o(&s);
  WFL::WriteUInt64(field, v, &o);
}

// `file` and every file it imports, each once, dependencies first.
void AddFile(const gp::FileDescriptor* file, std::set<std::string>& seen, std::string& out) {
  if (!seen.insert(file->name()).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) AddFile(file->dependency(i), seen, out);
  gp::FileDescriptorProto proto;
  file->CopyTo(&proto);
  PutBytes(out, 1, proto.SerializeAsString());  // FileDescriptorResponse.file_descriptor_proto
}

std::string Error(int code, const std::string& message) {
  std::string e;
  PutVarint(e, 1, static_cast<uint64_t>(code));
  PutBytes(e, 2, message);
  return e;
}

}  // namespace

std::string AnswerReflection(const std::string& request) {
  gp::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(request.data()),
                              static_cast<int>(request.size()));
  std::string host;
  int kind = 0;
  std::string arg;
  std::string ext_type;
  uint64_t ext_number = 0;
  bool ok = true;
  for (uint32_t tag; ok && (tag = in.ReadTag()) != 0;) {
    const int field = static_cast<int>(WFL::GetTagFieldNumber(tag));
    const bool delimited = WFL::GetTagWireType(tag) == WFL::WIRETYPE_LENGTH_DELIMITED;
    if (field == kHost && delimited) {
      ok = WFL::ReadString(&in, &host);
    } else if (delimited && (field == kFileByFilename || field == kFileContainingSymbol ||
                             field == kAllExtensionNumbersOfType || field == kListServices)) {
      kind = field;
      ok = WFL::ReadString(&in, &arg);
    } else if (delimited && field == kFileContainingExtension) {
      kind = field;
      std::string sub;
      ok = WFL::ReadString(&in, &sub);
      gp::io::CodedInputStream e(reinterpret_cast<const uint8_t*>(sub.data()),
                                 static_cast<int>(sub.size()));
      for (uint32_t t; ok && (t = e.ReadTag()) != 0;) {
        if (WFL::GetTagFieldNumber(t) == 1) {
          ok = WFL::ReadString(&e, &ext_type);
        } else if (WFL::GetTagFieldNumber(t) == 2) {
          ok = e.ReadVarint64(&ext_number);
        } else {
          ok = WFL::SkipField(&e, t);
        }
      }
    } else {
      ok = WFL::SkipField(&in, tag);
    }
  }
  std::string out;
  PutBytes(out, kValidHost, host);
  PutBytes(out, kOriginalRequest, request);
  const std::vector<std::string> services = Services();
  const gp::DescriptorPool* pool = gp::DescriptorPool::generated_pool();
  constexpr int kNotFound = 5, kInvalidArgument = 3;
  const gp::FileDescriptor* file = nullptr;
  std::string missing;
  if (!ok || kind == 0) {
    PutBytes(out, kErrorResponse,
             Error(kInvalidArgument, "not a valid grpc.reflection.v1alpha.ServerReflectionRequest"));
    return out;
  }
  switch (kind) {
    case kListServices: {
      std::string list;
      for (const auto& s : services) {
        std::string one;
        PutBytes(one, 1, s);  // ServiceResponse.name
        PutBytes(list, 1, one);
      }
      PutBytes(out, kListServicesResponse, list);
      return out;
    }
    case kFileByFilename:
      file = pool->FindFileByName(arg);
      missing = fmt::format("file '{}' not found", arg);
      break;
    case kFileContainingSymbol:
      file = pool->FindFileContainingSymbol(arg);
      missing = fmt::format("symbol '{}' not found", arg);
      break;
    case kFileContainingExtension: {
      const gp::Descriptor* d = pool->FindMessageTypeByName(ext_type);
      const gp::FieldDescriptor* f =
          d ? pool->FindExtensionByNumber(d, static_cast<int>(ext_number)) : nullptr;
      file = f ? f->file() : nullptr;
      missing = fmt::format("extension {} of '{}' not found", ext_number, ext_type);
      break;
    }
    case kAllExtensionNumbersOfType: {
      const gp::Descriptor* d = pool->FindMessageTypeByName(arg);
      if (d == nullptr) {
        PutBytes(out, kErrorResponse, Error(kNotFound, fmt::format("type '{}' not found", arg)));
        return out;
      }
      std::vector<const gp::FieldDescriptor*> exts;
      pool->FindAllExtensions(d, &exts);
      std::string r;
      PutBytes(r, 1, arg);
      for (const auto* f : exts) PutVarint(r, 2, static_cast<uint64_t>(f->number()));
      PutBytes(out, kAllExtensionNumbersResponse, r);
      return out;
    }
    default: break;
  }
  if (file == nullptr) {
    PutBytes(out, kErrorResponse, Error(kNotFound, missing));
    return out;
  }
  std::set<std::string> seen;
  std::string files;
  AddFile(file, seen, files);
  PutBytes(out, kFileDescriptorResponse, files);
  return out;
}

}  // namespace tandem::proxy::h2
