//! Shared bits of the runnable examples (see the files in this folder).
