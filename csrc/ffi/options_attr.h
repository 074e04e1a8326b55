// The FFI attributes of every attention target ARE the core's AttentionOptions:
// XLA decodes the whole attribute dictionary into the struct by member name
// (python/maxattn/_src/call.py Options.ffi_attributes() writes the same names).
// Adding a scalar option: a member in attention.h, a StructMember line here,
// a key in ffi_attributes(), and the code that uses it.
#ifndef MAXATTN_FFI_OPTIONS_ATTR_H_
#define MAXATTN_FFI_OPTIONS_ATTR_H_

#include "maxattn/attention.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(::maxattn::CausalAlignment);

// In the order of AttentionOptions' members (aggregate initialisation).
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::maxattn::AttentionOptions,
                                      ::xla::ffi::StructMember<float>("scale"),
                                      ::xla::ffi::StructMember<bool>("causal"),
                                      ::xla::ffi::StructMember<::maxattn::CausalAlignment>("alignment"),
                                      ::xla::ffi::StructMember<int64_t>("window_left"),
                                      ::xla::ffi::StructMember<int64_t>("window_right"),
                                      ::xla::ffi::StructMember<float>("softcap"),
                                      ::xla::ffi::StructMember<float>("dropout_rate"),
                                      ::xla::ffi::StructMember<int64_t>("max_segments"),
                                      ::xla::ffi::StructMember<bool>("deterministic"));

#endif  // MAXATTN_FFI_OPTIONS_ATTR_H_
