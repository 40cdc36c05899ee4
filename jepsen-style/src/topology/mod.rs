//! Topologies: where the nodes under test run and how faults reach them. `local` runs every
//! node as a child process on loopback; faults are signals to those processes.

pub mod local;
