"""The wire between the gateway, the client SDK and the Triton models: what each side sends and reads.

names          every model and tensor name (constants; no other file spells one)
requests       the public requests (synthesis, voice conversion, text piece, registration): typed, one builder
               and one parser each
outputs        the public models' answers: audio, speech marks, a registration
official       the official runtime's tensor form, and which model takes a request
stage_tensors  what one model sends another: llm, token2wav, the prompt encoder's steps
checks         the rules a request's values meet where it enters a process
tensors        typed reading of a request's tensors (`TensorReader`), STRING tensors
grpc_messages  Triton's gRPC messages from and to numpy; channel options
call_reader    the one reader of a decoupled gRPC call (final flag, end of the call, cancellation)

Never imports torch, the library's model floors or `pb_utils`: the client SDK installs without them
(tests/test_architecture.py holds the rule).
"""
