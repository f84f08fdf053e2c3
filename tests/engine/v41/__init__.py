"""DeepSeek V4.1 engine tests."""
