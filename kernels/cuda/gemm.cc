#include "kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

// cuBLASLt is opened on first use instead of being linked: linked, its
// ~94 KiB of static TLS is added to the minimum stack of every thread of
// every tandem process, and civetweb (prometheus-cpp's metrics exposer)
// starts its threads with a ~100 KiB stack, which pthread_create then
// refuses with EINVAL: no process could serve /metrics. Only a `cuda`
// backend needs cuBLASLt, so only it pays for loading it.
namespace {
struct LtApi {
  bool ok = false;
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
  decltype(&::cublasLtMatmulAlgoCheck) MatmulAlgoCheck = nullptr;
  decltype(&::cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
};

LtApi LoadLt() {
  LtApi api;
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
#ifdef TANDEM_CUDA_LIBRARY_DIR
  if (lib == nullptr) {
    lib = dlopen((std::string(TANDEM_CUDA_LIBRARY_DIR) + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
  }
#endif
  if (lib == nullptr) return api;
  api.Create = reinterpret_cast<decltype(&::cublasLtCreate)>(dlsym(lib, "cublasLtCreate"));
  if (api.Create == nullptr) return api;
  api.Destroy = reinterpret_cast<decltype(&::cublasLtDestroy)>(dlsym(lib, "cublasLtDestroy"));
  if (api.Destroy == nullptr) return api;
  api.Matmul = reinterpret_cast<decltype(&::cublasLtMatmul)>(dlsym(lib, "cublasLtMatmul"));
  if (api.Matmul == nullptr) return api;
  api.MatmulAlgoCheck = reinterpret_cast<decltype(&::cublasLtMatmulAlgoCheck)>(dlsym(lib, "cublasLtMatmulAlgoCheck"));
  if (api.MatmulAlgoCheck == nullptr) return api;
  api.MatmulAlgoConfigGetAttribute = reinterpret_cast<decltype(&::cublasLtMatmulAlgoConfigGetAttribute)>(dlsym(lib, "cublasLtMatmulAlgoConfigGetAttribute"));
  if (api.MatmulAlgoConfigGetAttribute == nullptr) return api;
  api.MatmulAlgoGetHeuristic = reinterpret_cast<decltype(&::cublasLtMatmulAlgoGetHeuristic)>(dlsym(lib, "cublasLtMatmulAlgoGetHeuristic"));
  if (api.MatmulAlgoGetHeuristic == nullptr) return api;
  api.MatmulDescCreate = reinterpret_cast<decltype(&::cublasLtMatmulDescCreate)>(dlsym(lib, "cublasLtMatmulDescCreate"));
  if (api.MatmulDescCreate == nullptr) return api;
  api.MatmulDescDestroy = reinterpret_cast<decltype(&::cublasLtMatmulDescDestroy)>(dlsym(lib, "cublasLtMatmulDescDestroy"));
  if (api.MatmulDescDestroy == nullptr) return api;
  api.MatmulDescSetAttribute = reinterpret_cast<decltype(&::cublasLtMatmulDescSetAttribute)>(dlsym(lib, "cublasLtMatmulDescSetAttribute"));
  if (api.MatmulDescSetAttribute == nullptr) return api;
  api.MatmulPreferenceCreate = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceCreate)>(dlsym(lib, "cublasLtMatmulPreferenceCreate"));
  if (api.MatmulPreferenceCreate == nullptr) return api;
  api.MatmulPreferenceDestroy = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceDestroy)>(dlsym(lib, "cublasLtMatmulPreferenceDestroy"));
  if (api.MatmulPreferenceDestroy == nullptr) return api;
  api.MatmulPreferenceSetAttribute = reinterpret_cast<decltype(&::cublasLtMatmulPreferenceSetAttribute)>(dlsym(lib, "cublasLtMatmulPreferenceSetAttribute"));
  if (api.MatmulPreferenceSetAttribute == nullptr) return api;
  api.MatrixLayoutCreate = reinterpret_cast<decltype(&::cublasLtMatrixLayoutCreate)>(dlsym(lib, "cublasLtMatrixLayoutCreate"));
  if (api.MatrixLayoutCreate == nullptr) return api;
  api.MatrixLayoutDestroy = reinterpret_cast<decltype(&::cublasLtMatrixLayoutDestroy)>(dlsym(lib, "cublasLtMatrixLayoutDestroy"));
  if (api.MatrixLayoutDestroy == nullptr) return api;
  api.ok = true;
  return api;
}

const LtApi& Lt() {
  static const LtApi api = LoadLt();
  return api;
}
}  // namespace
#define cublasLtCreate Lt().Create
#define cublasLtDestroy Lt().Destroy
#define cublasLtMatmul Lt().Matmul
#define cublasLtMatmulAlgoCheck Lt().MatmulAlgoCheck
#define cublasLtMatmulAlgoConfigGetAttribute Lt().MatmulAlgoConfigGetAttribute
#define cublasLtMatmulAlgoGetHeuristic Lt().MatmulAlgoGetHeuristic
#define cublasLtMatmulDescCreate Lt().MatmulDescCreate
#define cublasLtMatmulDescDestroy Lt().MatmulDescDestroy
#define cublasLtMatmulDescSetAttribute Lt().MatmulDescSetAttribute
#define cublasLtMatmulPreferenceCreate Lt().MatmulPreferenceCreate
#define cublasLtMatmulPreferenceDestroy Lt().MatmulPreferenceDestroy
#define cublasLtMatmulPreferenceSetAttribute Lt().MatmulPreferenceSetAttribute
#define cublasLtMatrixLayoutCreate Lt().MatrixLayoutCreate
#define cublasLtMatrixLayoutDestroy Lt().MatrixLayoutDestroy

namespace tandem::kernels::cuda {
namespace {

// The m whose algorithm every m uses in batch-invariant mode.
constexpr int kInvariantReferenceM = 256;

KernelStatus FromCublas(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return KernelStatus::Ok();
  return {KernelCode::kCublasError, static_cast<int>(st), what};
}

// Descriptors of one problem; destroyed with the object.
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~Problem() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
  // Row-major y[m][n] = x[m][k] w[n][k]^T is column-major
  // y^T (n x m) = op_T(w as k x n) * (x^T as k x m).
  KernelStatus Init(int m, int n, int k, GemmOutType out, const bf16* bias) {
    KernelStatus st = FromCublas(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                 "cublasLtMatmulDescCreate");
    if (!st.ok()) return st;
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    st = FromCublas(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                                   sizeof(trans_a)),
                    "cublasLt TRANSA");
    if (!st.ok()) return st;
    st = FromCublas(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                                   sizeof(trans_b)),
                    "cublasLt TRANSB");
    if (!st.ok()) return st;
    if (bias != nullptr) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      st = FromCublas(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                     sizeof(epi)),
                      "cublasLt EPILOGUE");
      if (!st.ok()) return st;
      const cudaDataType_t bias_type = CUDA_R_16BF;
      st = FromCublas(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof(bias_type)),
                      "cublasLt BIAS_DATA_TYPE");
      if (!st.ok()) return st;
      st = FromCublas(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)),
                      "cublasLt BIAS_POINTER");
      if (!st.ok()) return st;
    }
    const cudaDataType_t out_type = out == GemmOutType::kBf16 ? CUDA_R_16BF : CUDA_R_32F;
    st = FromCublas(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k), "cublasLt layout A");
    if (!st.ok()) return st;
    st = FromCublas(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, k), "cublasLt layout B");
    if (!st.ok()) return st;
    return FromCublas(cublasLtMatrixLayoutCreate(&c, out_type, n, m, n), "cublasLt layout C");
  }
};

}  // namespace

struct GemmContext::Algo {
  cublasLtMatmulAlgo_t algo;
};

KernelStatus GemmContext::Create(void* workspace, size_t workspace_bytes, bool batch_invariant,
                                 std::unique_ptr<GemmContext>* out) {
  if (!Lt().ok) {
    return {KernelCode::kCublasError, static_cast<int>(CUBLAS_STATUS_NOT_INITIALIZED),
            "cannot load libcublasLt (dlopen)"};
  }
  std::unique_ptr<GemmContext> ctx(new GemmContext());
  cublasLtHandle_t h = nullptr;
  KernelStatus st = FromCublas(cublasLtCreate(&h), "cublasLtCreate");
  if (!st.ok()) return st;
  ctx->handle_ = h;
  ctx->workspace_ = workspace;
  ctx->workspace_bytes_ = workspace_bytes;
  ctx->batch_invariant_ = batch_invariant;
  *out = std::move(ctx);
  return KernelStatus::Ok();
}

GemmContext::~GemmContext() {
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

KernelStatus GemmContext::Gemm(const bf16* x, const bf16* w, const bf16* bias, void* y,
                               GemmOutType out_type, int m, int n, int k, cudaStream_t stream) {
  if (m < 0 || n <= 0 || k <= 0) return InvalidArgument("Gemm: m >= 0, n > 0, k > 0");
  if (bias != nullptr && out_type != GemmOutType::kBf16) {
    return Unsupported("Gemm: a bias needs bf16 output");
  }
  if (m == 0) return KernelStatus::Ok();
  Problem prob;
  KernelStatus st = prob.Init(m, n, k, out_type, bias);
  if (!st.ok()) return st;

  const int algo_m = batch_invariant_ ? kInvariantReferenceM : m;
  const auto key = std::make_tuple(algo_m, n, k, static_cast<int>(out_type), bias != nullptr);
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    Problem ref;
    if (batch_invariant_) {
      st = ref.Init(algo_m, n, k, out_type, bias);
      if (!st.ok()) return st;
    }
    const Problem& q = batch_invariant_ ? ref : prob;
    cublasLtMatmulPreference_t pref = nullptr;
    st = FromCublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (!st.ok()) return st;
    uint64_t ws = workspace_bytes_;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof(ws));
    constexpr int kWanted = 16;
    cublasLtMatmulHeuristicResult_t results[kWanted] = {};
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
        reinterpret_cast<cublasLtHandle_t>(handle_), q.op, q.a, q.b, q.c, q.c, pref, kWanted,
        results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      return {KernelCode::kCublasError, static_cast<int>(hs), "Gemm: no cuBLASLt algorithm"};
    }
    int chosen = -1;
    for (int i = 0; i < found && chosen < 0; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      if (!batch_invariant_) {
        chosen = i;
        break;
      }
      // Invariance needs one output element = one reduction over k in one
      // order: no split-K.
      int32_t splitk = 1;
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                           &splitk, sizeof(splitk), &written);
      if (splitk <= 1) chosen = i;
    }
    if (chosen < 0) {
      return Unsupported("Gemm: no cuBLASLt algorithm without split-K for batch-invariant mode");
    }
    auto algo = std::make_unique<Algo>();
    algo->algo = results[chosen].algo;
    it = algos_.emplace(key, std::move(algo)).first;
  }
  if (batch_invariant_) {
    cublasLtMatmulHeuristicResult_t check = {};
    const cublasStatus_t cs = cublasLtMatmulAlgoCheck(reinterpret_cast<cublasLtHandle_t>(handle_),
                                                      prob.op, prob.a, prob.b, prob.c, prob.c,
                                                      &it->second->algo, &check);
    if (cs != CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes_) {
      return {KernelCode::kCublasError, static_cast<int>(cs),
              "Gemm: the batch-invariant algorithm does not run at this m"};
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  return FromCublas(cublasLtMatmul(reinterpret_cast<cublasLtHandle_t>(handle_), prob.op, &alpha, w,
                                   prob.a, x, prob.b, &beta, y, prob.c, y, prob.c,
                                   &it->second->algo, workspace_, workspace_bytes_, stream),
                    "cublasLtMatmul");
}

}  // namespace tandem::kernels::cuda
