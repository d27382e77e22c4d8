"""A package's MIL program, read and run without Core ML: the protobuf and
weight-blob reader (`program`, `inspect`), the interpreter (`ops`, `interp`,
`chunk`), canonical names (`names`), the program writer (`write`) and the
Neural Engine audit (`audit`, with its op table `ane_op_types.json`)."""
