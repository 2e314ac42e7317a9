//! NCCL on a real GPU (`PT_TEST_DEVICE=cuda`, where NCCL must load: a GPU check that could not
//! find it says so instead of passing; elsewhere there is no communicator to make, and these
//! return at once).

use crate::harness::{devices, host, param};
use pipetransformer::comm::Communicator;
use pipetransformer::comm::nccl::NcclCommunicator;
use pipetransformer::device::{Precision, cuda};

/// A one-GPU group sums in place (to itself); once aborted, its collectives are refused
/// instead of reaching NCCL with the freed communicator.
#[test]
fn an_aborted_group_refuses_collectives() {
    if std::env::var("PT_TEST_DEVICE").as_deref() != Ok("cuda") {
        return;
    }
    let dev = devices(Precision::F32).remove(0);
    let rt = cuda::runtime_of(&dev).expect("a cuda device");
    let comm = NcclCommunicator::group(&[rt]).expect("NCCL group").remove(0);
    let mut buf = param(&dev, &[1.0, 2.0, 3.0]);
    comm.all_reduce_sum(&dev, &mut [&mut buf]).unwrap();
    comm.complete(&dev).unwrap();
    assert_eq!(host(&dev, &buf), [1.0, 2.0, 3.0]);
    comm.abort();
    let err = comm.all_reduce_sum(&dev, &mut [&mut buf]).expect_err("aborted").to_string();
    assert!(err.contains("aborted"), "{err}");
    assert!(comm.broadcast(&dev, &mut buf, 0).is_err());
}
