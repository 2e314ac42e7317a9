//! Collective communication between the replicas of a data-parallel run (DESIGN.md §4): a
//! [`Communicator`] sums gradients across its group's members. Two implementations:
//! [`ring`] (in-process threads: reduce-scatter then all-gather over chunks, for `cpu` and
//! `cuda-emu` devices) and [`nccl`] (NCCL, opened by [`nccl_lib`], for `cuda` devices, one communicator per
//! GPU, the unique id exchanged over a TCP rendezvous for multi-process and multi-node runs).

pub mod nccl;
pub mod nccl_lib;
pub mod peers;
pub mod process_group;
pub mod rendezvous;
pub mod ring;
pub mod watchdog;

pub use ring::{RingCommunicator, ring_group};

use crate::device::Device;
use crate::error::Result;

/// One member of a communication group.
pub trait Communicator<D: Device>: Send + Sync {
    /// This member's index in the group.
    fn rank(&self) -> usize;
    /// Members in the group.
    fn size(&self) -> usize;
    /// What moves the bytes, for the console: e.g. `host ring`, `NCCL 2.32.3 (path)`.
    fn name(&self) -> String;
    /// Every member's `bufs` become the element-wise sum over all members (every member passes
    /// buffers of the same lengths, in the same order: a bucket of gradients).
    fn all_reduce_sum(&self, dev: &D, bufs: &mut [&mut D::Buf]) -> Result<()>;
    /// Makes `dev`'s later work wait for the collectives this member queued: NCCL runs them on
    /// a stream of its own so they overlap the rest of the backward. The default, for
    /// collectives that are done when they return, does nothing.
    fn complete(&self, _dev: &D) -> Result<()> {
        Ok(())
    }
    /// Every member's `buf` becomes `root`'s.
    fn broadcast(&self, dev: &D, buf: &mut D::Buf, root: usize) -> Result<()>;
    /// Ends this member's collectives, failed: those in flight return errors, later ones fail.
    /// Called from another thread while a collective may wait for a peer that is gone (NCCL's
    /// `ncclCommAbort`; the [watchdog](watchdog::Watchdog)). The default, for collectives that
    /// end with their members (the in-process ring), does nothing.
    fn abort(&self) {}
}
