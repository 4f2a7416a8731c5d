"""What a chunk may go through below DRAM: codecs (how it is stored), the S3 remote tier, GPUDirect NVMe I/O."""
