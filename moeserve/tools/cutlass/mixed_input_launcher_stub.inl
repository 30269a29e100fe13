// Stands in for TensorRT-LLM's moe_gemm_tma_ws_mixed_input_launcher.inl in moeserve's build of the CUTLASS MoE
// module: the mixed-input (W4A8 / W4A16) grouped GEMM launchers keep their symbols, which the module's
// dispatch code references, but raise when called. moeserve runs no mixed-input MoE, and these kernels are
// most of the module's compile time.
#include "cute/tensor.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass_extensions/epilogue_helpers.h"
#include "tensorrt_llm/common/assert.h"
#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.h"

namespace tensorrt_llm {
namespace kernels {
namespace cutlass_kernels_oss {
template <typename T, typename WeightType, typename GemmOutputType, typename EpilogueTag,
          typename CTAShape, typename ClusterShape, typename MainloopScheduleType,
          typename EpilogueScheduleType, cutlass::WeightOnlyQuantOp QuantOp>
void sm90_generic_mixed_moe_gemm_kernelLauncher(
    tensorrt_llm::kernels::cutlass_kernels::GroupedGemmInput<T, WeightType, GemmOutputType,
                                                             GemmOutputType>
        inputs,
    TmaWarpSpecializedGroupedGemmInput hopper_inputs, int sm_count_, size_t* workspace_size) {
  TLLM_THROW("mixed-input grouped GEMMs (W4A8/W4A16) are not in this build of the module (moeserve precompile)");
}
}  // namespace cutlass_kernels_oss
}  // namespace kernels
}  // namespace tensorrt_llm
