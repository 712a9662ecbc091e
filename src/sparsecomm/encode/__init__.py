"""Encoding: index codecs (`sparsecomm.encode.index`) and value codecs (`sparsecomm.encode.value`),
combined into one self-describing payload by `sparsecomm.payload`."""
