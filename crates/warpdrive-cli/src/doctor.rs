//! `warpdrive doctor`: the devices, in words, and the machine's ceilings.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;
use warpdrive::{Device, DeviceInfo};
use warpdrive_bench as bench;

use crate::flags::{DeviceOpt, ScaleOpt};
use crate::results_file::{check_output, fail_on, save_results};

pub(crate) fn doctor(device: &DeviceOpt, scale: &ScaleOpt, json: Option<&Path>) -> Result<()> {
    if let Some(path) = json {
        check_output(path)?;
    }
    // Opened first: a bad --device fails before the report starts.
    let device = device.open()?;
    println!(
        "warpdrive {} (git {})",
        env!("CARGO_PKG_VERSION"),
        warpdrive::GIT_REV
    );
    let count = Device::cuda_count();
    println!("CUDA devices: {count}");
    if count == 0 {
        println!();
        println!("cpu");
        print_info(&Device::cpu().info()?);
    }
    for n in 0..count {
        println!();
        println!("cuda:{n}");
        match Device::cuda(n).and_then(|d| d.info()) {
            Ok(info) => print_info(&info),
            Err(e) => println!("  error: {e}"),
        }
    }

    let scale = scale.on(&device);
    println!();
    println!(
        "measuring ceilings on {} ({} sizes)...",
        device.label(),
        scale.name()
    );
    if scale.quick() {
        println!(
            "note: {} sizes are smaller than a full GPU run's",
            scale.name()
        );
    }
    let ceilings = bench::select_suites(&["ceilings"])?;
    let outcome = bench::run_suites(&device, &ceilings, scale)?;
    println!();
    println!("ceilings on {}:", device.label());
    print!(
        "{}",
        indent(&bench::format_ceilings(&outcome.results.ceilings))
    );
    match json {
        Some(path) => {
            let saved = save_results(&outcome.results, &outcome.failed, path)?;
            println!("results written to {}", saved.display());
            Ok(())
        }
        None => fail_on(&outcome.failed),
    }
}

/// Every field of `info`, one per line, then the libraries.
pub(crate) fn print_info(info: &DeviceInfo) {
    let Ok(Value::Object(mut fields)) = serde_json::to_value(info) else {
        println!("  {info:?}");
        return;
    };
    fields.insert(
        "pcie".into(),
        info.pcie().map_or(Value::Null, Value::String),
    );
    fields.insert("numa".into(), Value::String(numa_line(&info.numa)));
    fields.insert("gpudirect_storage".into(), Value::String(gds_line().into()));
    let width = fields.keys().map(String::len).max().unwrap_or(0);
    for (key, value) in &fields {
        if key == "libraries" {
            continue;
        }
        println!("  {key:<width$}  {}", show(value));
    }
    println!("  libraries:");
    let lib_width = info
        .libraries
        .iter()
        .map(|l| l.name.len())
        .max()
        .unwrap_or(0);
    for lib in &info.libraries {
        let state = match (lib.loaded, lib.version.as_deref()) {
            (true, Some(version)) => format!("loaded   {version}"),
            (true, None) => "loaded   (version not reported)".into(),
            (false, _) => format!("missing  ({})", missing_library(lib.name)),
        };
        println!("    {:<lib_width$}  {state}", lib.name);
    }
}

/// What GPUDirect Storage would do here, in words.
fn gds_line() -> &'static str {
    match warpdrive::device::gds_mode() {
        warpdrive::device::GdsMode::Absent => "absent (no libcufile): POSIX I/O",
        warpdrive::device::GdsMode::Compatibility => {
            "compatibility mode (libcufile without the nvidia-fs driver: host bounce buffers)"
        }
        warpdrive::device::GdsMode::Direct => "direct (libcufile and the nvidia-fs driver)",
    }
}

/// Where host memory and staging threads go, in words.
pub(crate) fn numa_line(numa: &warpdrive::device::sysfs::NumaPlacement) -> String {
    let nodes = format!("{} node(s) on this machine", numa.nodes);
    match numa.node {
        Some(node) => format!(
            "node {node} ({} CPUs; {nodes}): host memory and staging threads go there",
            numa.cpus.len()
        ),
        None => format!("no placement ({nodes}, or none named for this device)"),
    }
}

/// Why a CUDA library is missing and what goes without it.
pub(crate) fn missing_library(name: &str) -> &'static str {
    match name {
        "driver" => "libcuda.so could not be loaded: no NVIDIA driver; no CUDA device",
        "nvrtc" => "libnvrtc.so could not be loaded: no CUDA toolkit; kernels cannot compile",
        "cublas" => "libcublas.so could not be loaded: GEMMs through cuBLAS unavailable",
        "cublaslt" => "libcublasLt.so could not be loaded: cuBLASLt GEMMs unavailable",
        "nccl" => "libnccl.so could not be loaded: multi-GPU collectives unavailable",
        "cufile" => "libcufile.so could not be loaded: GPUDirect Storage unavailable",
        _ => "could not be loaded",
    }
}

/// A JSON value as plain text (`-` for null, strings unquoted).
pub(crate) fn show(value: &Value) -> String {
    match value {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub(crate) fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}
