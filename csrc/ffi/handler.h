// The four FFI handlers (forward/backward x cpu/cuda) from one template.
//
// A Platform supplies the target names, the dtype of a bias, its execution
// context (bound first) and the core call:
//
//   struct Platform {
//     static constexpr const char* kForwardName, *kBackwardName;
//     static constexpr bool kMaxLogitOverBatch;  // takes a [1, N] max_logit (reduced over the batch)
//     using Context = ContextTypes<Ctx...>;   // what Bind() binds, in order
//     static auto Bind();                     // ffi::Ffi::Bind() plus .Ctx<>() for each context
//     static ffi::DataType BiasType(ffi::DataType input);
//     static ffi::Error Forward(Ctx..., const DecodedCall&, const ForwardOutputs&);
//     static ffi::Error Backward(Ctx..., const DecodedCall&, const BackwardInputs&, const BackwardOutputs&);
//   };
//
// Every handler takes the context, the eleven operands of decode.h, the
// AttentionOptions attribute struct, then direction-specific buffers.
#ifndef MAXATTN_FFI_HANDLER_H_
#define MAXATTN_FFI_HANDLER_H_

#include <utility>

#include "ffi/decode.h"
#include "ffi/options_attr.h"

namespace maxattn::ffi_glue {

using Buffer = ffi::AnyBuffer;
using Result = ffi::Result<ffi::AnyBuffer>;

template <typename Binding>
auto BindOperands(Binding binding) {
  return std::move(binding)
      .template Arg<Buffer>()   // q [B, T, N, H]
      .template Arg<Buffer>()   // k [B, S, K, H]
      .template Arg<Buffer>()   // v [B, S, K, Hv]
      .template Arg<Buffer>()   // bias [b', n', t', s'] or [0]
      .template Arg<Buffer>()   // mask [b', n', t', s'] pred or [0]
      .template Arg<Buffer>()   // q_seq_lengths [B] s32 or [0]
      .template Arg<Buffer>()   // kv_seq_lengths [B] s32 or [0]
      .template Arg<Buffer>()   // q_segment_ids [B, T] s32 or [0]
      .template Arg<Buffer>()   // kv_segment_ids [B, S] s32 or [0]
      .template Arg<Buffer>()   // sink_logits [N] f32 or [0] (vanilla softmax)
      .template Arg<Buffer>()   // dropout_seed [4] u32 or [0] (no dropout)
      .template Attrs<AttentionOptions>();
}

template <typename... Ctx>
struct ContextTypes {};

template <typename Platform>
auto BindForward() {
  return BindOperands(Platform::Bind())
      .template Ret<Buffer>()   // out [B, T, N, Hv]
      .template Ret<Buffer>()   // lse [B, N, T] f32, or [0]
      .template Ret<Buffer>();  // max_logit [B, N] f32 ([1, N] if kMaxLogitOverBatch), or [0]
}

template <typename Platform>
auto BindBackward() {
  return BindOperands(Platform::Bind())
      .template Arg<Buffer>()   // out [B, T, N, Hv]
      .template Arg<Buffer>()   // dout [B, T, N, Hv]
      .template Arg<Buffer>()   // lse [B, N, T] f32
      .template Arg<Buffer>()   // dlse [B, N, T] f32, or [0] (zero)
      .template Ret<Buffer>()   // dq
      .template Ret<Buffer>()   // dk
      .template Ret<Buffer>()   // dv
      .template Ret<Buffer>()   // dbias like bias, or [0]
      .template Ret<Buffer>();  // dsink [B, N] f32, or [0]
}

// The direction-specific part of a handler: the buffers after the options.
struct Forward {
  template <typename Platform>
  static constexpr const char* kName = Platform::kForwardName;

  template <typename Platform, typename... Ctx>
  static ffi::Error Run(const DecodedCall& call, ffi::DataType dtype, Result out, Result lse, Result max_logit,
                        Ctx&... ctx) {
    ForwardOutputs outputs;
    MAXATTN_FFI_RETURN_IF_ERROR(
        DecodeForwardOutputs(kName<Platform>, call, dtype, *out, *lse, *max_logit, Platform::kMaxLogitOverBatch,
                             &outputs));
    return Platform::Forward(ctx..., call, outputs);
  }
};

struct Backward {
  template <typename Platform>
  static constexpr const char* kName = Platform::kBackwardName;

  template <typename Platform, typename... Ctx>
  static ffi::Error Run(const DecodedCall& call, ffi::DataType dtype, Buffer out, Buffer dout, Buffer lse,
                        Buffer dlse, Result dq, Result dk, Result dv, Result dbias, Result dsink, Ctx&... ctx) {
    BackwardInputs saved;
    BackwardOutputs grads;
    MAXATTN_FFI_RETURN_IF_ERROR(DecodeBackwardBuffers(kName<Platform>, call, dtype, Platform::BiasType(dtype), out,
                                                      dout, lse, dlse, *dq, *dk, *dv, *dbias, *dsink, &saved,
                                                      &grads));
    return Platform::Backward(ctx..., call, saved, grads);
  }
};

// The handler: context, the eleven operands and the options are decoded here;
// the rest goes to the direction.
template <typename Platform, typename Direction, typename Context = typename Platform::Context>
struct Handler;

template <typename Platform, typename Direction, typename... Ctx>
struct Handler<Platform, Direction, ContextTypes<Ctx...>> {
  template <typename... Rest>
  ffi::Error operator()(Ctx... ctx, Buffer q, Buffer k, Buffer v, Buffer bias, Buffer mask, Buffer q_seq_lengths,
                        Buffer kv_seq_lengths, Buffer q_segment_ids, Buffer kv_segment_ids, Buffer sink_logits,
                        Buffer dropout_seed, AttentionOptions options, Rest... rest) const {
    DecodedCall call;
    MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(Direction::template kName<Platform>,
                                           {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids,
                                            kv_segment_ids, sink_logits, dropout_seed},
                                           options, Platform::BiasType(q.element_type()), &call));
    return Direction::template Run<Platform>(call, q.element_type(), rest..., ctx...);
  }
};

}  // namespace maxattn::ffi_glue

#endif  // MAXATTN_FFI_HANDLER_H_
