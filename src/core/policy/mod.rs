//! SKELETON: the policy model is being written.
