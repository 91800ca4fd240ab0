"""What agents need from a DeepSeek V4 server: the exact V4 prompt encoding (`encoding`),
DSML tool-call parsing (`dsml`)."""
