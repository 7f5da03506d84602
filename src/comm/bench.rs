//! Bandwidth probe for the in-process all-reduce (used by `meshwork bench allreduce` and the
//! criterion bench).
