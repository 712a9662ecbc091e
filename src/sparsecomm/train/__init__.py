"""``sparsecomm train``: real workloads trained by P local workers with every preset next to dense."""
