"""What DeepSeek V4 and V4.1 share: norms, the grouped linear, the clamped SwiGLU, the window mask and
sink softmax, the mHC mixing matrix, per-sequence state, and the helpers both loaders use."""
