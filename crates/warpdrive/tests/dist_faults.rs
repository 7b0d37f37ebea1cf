//! The in-process communicator group's failures (`dist`): ranks that leave, panic or never
//! arrive fail on every rank within the timeout and the group goes on where it can;
//! bad arguments are refused; buffers of the wrong backend are refused.

mod common;

use std::time::Duration;

use common::{each_rank, group, is_collective, is_invalid};
use warpdrive::dist::{Comm, ReduceOp};
use warpdrive::{Buffer, Device, Error};

/// Long enough never to be reached by a healthy call.
const PATIENT: Duration = Duration::from_secs(30);

#[test]
fn a_rank_that_drops_its_comm_aborts_the_group_at_once() {
    const WORLD: usize = 3;
    let mut comms = group(WORLD, PATIENT);
    let leaver = comms.pop().expect("rank 2");
    let outs = std::thread::scope(|s| {
        s.spawn(move || drop(leaver));
        each_rank(comms, |comm, stream| {
            let mut buf = Buffer::from_host(stream, &[1.0f32, 2.0, 3.0]).unwrap();
            let first = comm
                .all_reduce(stream, &mut buf, ReduceOp::Sum)
                .unwrap_err();
            let later = comm.broadcast(stream, &mut buf, 0).unwrap_err();
            (first, later)
        })
    });
    // An abort that names the rank, not a timeout (whose error says so).
    for (rank, (first, later)) in outs.iter().enumerate() {
        for e in [first, later] {
            assert!(
                is_collective(e, "rank 2 left the group"),
                "rank {rank}: {e}"
            );
        }
    }
}

#[test]
fn a_rank_that_panics_aborts_the_group() {
    let mut comms = group(2, PATIENT);
    let doomed = comms.pop().expect("rank 1");
    let panicker = std::thread::spawn(move || {
        let _comm = doomed;
        panic!("rank 1 fails on purpose (dist test)");
    });
    let outs = each_rank(comms, |comm, stream| {
        let mut buf = Buffer::from_host(stream, &[1.0f32; 5]).unwrap();
        comm.all_reduce(stream, &mut buf, ReduceOp::Sum)
            .unwrap_err()
    });
    assert!(panicker.join().is_err());
    assert!(
        is_collective(&outs[0], "rank 1 left the group"),
        "{}",
        outs[0]
    );
    assert!(outs[0].to_string().contains("panicked"), "{}", outs[0]);
}

#[test]
fn a_rank_that_never_calls_times_the_others_out() {
    let timeout = Duration::from_millis(200);
    let mut comms = group(3, timeout);
    let absent = comms.pop().expect("rank 2");
    let outs = each_rank(comms, |comm, stream| {
        let mut buf = Buffer::from_host(stream, &[1.0f32; 9]).unwrap();
        comm.all_reduce(stream, &mut buf, ReduceOp::Sum)
            .unwrap_err()
    });
    for (rank, e) in outs.iter().enumerate() {
        let text = e.to_string();
        assert!(
            is_collective(e, "did not arrive")
                && text.contains("all_reduce")
                && text.contains("2]"),
            "rank {rank}: {text}"
        );
    }
    // The group is aborted: the latecomer fails at once too.
    let stream = Device::cpu().new_stream().unwrap();
    let mut buf = Buffer::from_host(&stream, &[1.0f32; 9]).unwrap();
    let e = absent
        .all_reduce(&stream, &mut buf, ReduceOp::Sum)
        .unwrap_err();
    assert!(is_collective(&e, "the group is aborted"), "{e}");
}

#[test]
fn a_recv_of_another_length_fails_and_aborts_the_group() {
    let outs = each_rank(group(2, PATIENT), |comm, stream| {
        if comm.rank() == 0 {
            let buf = Buffer::from_host(stream, &[1.0f32; 5]).unwrap();
            comm.send(stream, &buf, 1).unwrap();
            let mut back = Buffer::from_host(stream, &[0.0f32; 5]).unwrap();
            comm.recv(stream, &mut back, 1).unwrap_err()
        } else {
            let mut buf = Buffer::from_host(stream, &[0.0f32; 6]).unwrap();
            comm.recv(stream, &mut buf, 0).unwrap_err()
        }
    });
    assert!(is_collective(&outs[1], "received f32 × 5"), "{}", outs[1]);
    assert!(
        is_collective(&outs[0], "the group is aborted"),
        "{}",
        outs[0]
    );
}

#[test]
fn invalid_arguments_are_refused() {
    assert!(matches!(
        Comm::local_group(0, PATIENT),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        Comm::local_group(2, Duration::ZERO),
        Err(Error::InvalidArgument(_))
    ));

    let comm = group(1, PATIENT).pop().unwrap();
    assert_eq!((comm.rank(), comm.world(), comm.timeout()), (0, 1, PATIENT));
    let stream = Device::cpu().new_stream().unwrap();
    let seven = Buffer::from_host(&stream, &[1.0f32; 7]).unwrap();
    let mut out = Buffer::from_host(&stream, &[0.0f32; 2]).unwrap();
    let mut buf = Buffer::from_host(&stream, &[1.0f32; 7]).unwrap();
    assert!(is_invalid(
        comm.broadcast(&stream, &mut buf, 1),
        "root 1 is out of range"
    ));
    assert!(is_invalid(comm.send(&stream, &seven, 0), "itself"));
    assert!(is_invalid(
        comm.send(&stream, &seven, 3),
        "peer 3 is out of range"
    ));
    assert!(is_invalid(comm.recv(&stream, &mut buf, 0), "itself"));
    assert!(is_invalid(
        comm.all_gather(&stream, &seven, &mut out),
        "need 7"
    ));
    assert!(is_invalid(
        comm.reduce_scatter(&stream, &seven, &mut out, ReduceOp::Sum),
        "need 2"
    ));
    assert!(is_invalid(
        comm.all_to_all(&stream, &seven, &mut out),
        "the same number"
    ));
    // The refused steps left the group usable.
    comm.all_reduce(&stream, &mut buf, ReduceOp::Sum).unwrap();
    assert_eq!(buf.to_host(&stream).unwrap(), [1.0f32; 7]);

    // Lengths that do not divide, on every rank: each gets its own argument error.
    let outs = each_rank(group(3, PATIENT), |comm, stream| {
        let input = Buffer::from_host(stream, &[1.0f32; 7]).unwrap();
        let mut output = Buffer::from_host(stream, &[0.0f32; 7]).unwrap();
        let refused = comm.all_to_all(stream, &input, &mut output);
        let mut ok = Buffer::from_host(stream, &[1.0f32; 3]).unwrap();
        (refused, comm.all_reduce(stream, &mut ok, ReduceOp::Sum))
    });
    for (refused, then) in outs {
        assert!(is_invalid(refused, "divisible"));
        then.unwrap();
    }

    // A bad root on one rank: its argument error there, a refusal naming it on the others.
    let outs = each_rank(group(2, PATIENT), |comm, stream| {
        let mut buf = Buffer::from_host(stream, &[1.0f32; 4]).unwrap();
        let root = if comm.rank() == 0 { 5 } else { 0 };
        comm.broadcast(stream, &mut buf, root)
    });
    let mut outs = outs.into_iter();
    assert!(is_invalid(outs.next().unwrap(), "root 5"));
    let other = outs.next().unwrap().unwrap_err();
    assert!(
        is_collective(&other, "rank 0's call at step 0 was refused"),
        "{other}"
    );
}

#[test]
fn comm_moves_between_threads() {
    fn is_send<T: Send>() {}
    is_send::<Comm>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_buffers_on_a_cpu_group_are_refused() {
    let device = common::cuda();
    let stream = device.new_stream().unwrap();
    let comm = group(1, PATIENT).pop().unwrap();
    let mut buf = Buffer::from_host(&stream, &[1.0f32; 4]).unwrap();
    let e = comm
        .all_reduce(&stream, &mut buf, ReduceOp::Sum)
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("NCCL communicator")),
        "{e}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (and NCCL)"]
fn gpu_nccl_refuses_buffers_of_another_device_and_cpu_streams() {
    let device = common::cuda();
    let comm = Comm::nccl_group(std::slice::from_ref(&device), PATIENT)
        .unwrap()
        .pop()
        .unwrap();
    let cpu = Device::cpu().new_stream().unwrap();
    let mut host = Buffer::from_host(&cpu, &[1.0f32; 4]).unwrap();
    let e = comm.all_reduce(&cpu, &mut host, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    let stream = device.new_stream().unwrap();
    let mut buf = Buffer::from_host(&stream, &[1.0f32; 6]).unwrap();
    let mut out = Buffer::from_host(&stream, &[0.0f32; 5]).unwrap();
    let e = comm.all_gather(&stream, &buf, &mut out).unwrap_err();
    assert!(is_invalid(Err(e), "output holds 5"));
    // The refused calls left the communicator usable.
    comm.all_reduce(&stream, &mut buf, ReduceOp::Max).unwrap();
    comm.wait(&stream).unwrap();
    assert_eq!(buf.to_host(&stream).unwrap(), [1.0f32; 6]);
}
