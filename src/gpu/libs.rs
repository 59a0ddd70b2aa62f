//! Finding and loading CUDA's libraries at run time.
//!
//! Each library is looked for under the names its releases really carry, first in the
//! directories the caller gives (the Python side passes the `nvidia/*/lib` folders of
//! the installed nvidia-* wheels), then in `LD_LIBRARY_PATH`, `CUDA_HOME`/`CUDA_PATH`
//! and the system's usual places, and last by bare name through the dynamic loader.
//! A library, once loaded, stays loaded for the life of the process: later loads by
//! its SONAME (as cudarc does) find it whatever directory it came from.

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

/// One of the libraries the GPU path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLib {
    /// The CUDA driver (`libcuda.so.1`), installed with the GPU driver.
    Driver,
    /// The run-time compiler of the kernels (`libnvrtc.so.13` or `.12`).
    Nvrtc,
    /// NCCL (`libnccl.so.2`), the transport between GPUs.
    Nccl,
}

impl CudaLib {
    /// Every library, in report order.
    pub const ALL: [CudaLib; 3] = [CudaLib::Driver, CudaLib::Nvrtc, CudaLib::Nccl];

    /// The name reports use.
    pub fn label(self) -> &'static str {
        match self {
            CudaLib::Driver => "CUDA driver",
            CudaLib::Nvrtc => "NVRTC",
            CudaLib::Nccl => "NCCL",
        }
    }

    /// The function each library is asked its version with (it needs no GPU); its
    /// address also tells which loaded copy a caller is bound to.
    fn version_symbol(self) -> &'static [u8] {
        match self {
            CudaLib::Driver => b"cuDriverGetVersion\0",
            CudaLib::Nvrtc => b"nvrtcVersion\0",
            CudaLib::Nccl => b"ncclGetVersion\0",
        }
    }

    /// A function that does the library's work, checked beside the version function.
    fn working_symbol(self) -> &'static [u8] {
        match self {
            CudaLib::Driver => b"cuLaunchKernel\0",
            CudaLib::Nvrtc => b"nvrtcCompileProgram\0",
            CudaLib::Nccl => b"ncclAllReduce\0",
        }
    }

    /// The file names to look for, most wanted first.
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
            CudaLib::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }
}

/// A library that was found and loaded.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The file it was loaded from (the bare name when the dynamic loader found it).
    pub path: PathBuf,
    /// Its version, as the library reports it ("13.2", "2.28.7").
    pub version: String,
}

/// What a search for one library found.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The library.
    pub lib: CudaLib,
    /// Where it was loaded from, or None.
    pub loaded: Option<Loaded>,
    /// Every place tried, in order (for the error message when it is missing).
    pub searched: Vec<String>,
    /// The loader's last complaint, when a file existed but would not load.
    pub error: Option<String>,
}

impl Probe {
    /// The sentence an error gives when the library is missing.
    pub fn missing_message(&self) -> String {
        let mut msg = format!(
            "{} ({}) was not found; searched: {}",
            self.lib.label(),
            self.lib.file_names().join(" or "),
            self.searched.join(", ")
        );
        if let Some(e) = &self.error {
            msg.push_str(&format!("; the last load failed with: {e}"));
        }
        msg
    }
}

fn loaded() -> &'static Mutex<HashMap<CudaLib, (Loaded, Library)>> {
    static LOADED: OnceLock<Mutex<HashMap<CudaLib, (Loaded, Library)>>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The directories searched after the caller's, in order.
pub fn default_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(paths) = crate::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = crate::env::var_os(var) {
            dirs.push(Path::new(&root).join("lib64"));
            dirs.push(Path::new(&root).join("lib"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// Finds and loads `lib` (once per process), searching `dirs` first. NVRTC is chosen
/// to suit the CUDA driver, where there is one (see [`prefer_for_driver`]).
pub fn probe(lib: CudaLib, dirs: &[PathBuf]) -> Probe {
    // The driver's major version, for NVRTC's choice (probed before the table is
    // locked: it is an entry of its own).
    let driver = (lib == CudaLib::Nvrtc && !is_loaded(lib))
        .then(|| probe(CudaLib::Driver, dirs).loaded)
        .flatten()
        .and_then(|d| major(&d.version));
    let mut table = loaded().lock().unwrap_or_else(|p| p.into_inner());
    let mut probe = Probe {
        lib,
        loaded: None,
        searched: Vec::new(),
        error: None,
    };
    if let Some((found, _)) = table.get(&lib) {
        probe.loaded = Some(found.clone());
        return probe;
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    for dir in dirs.iter().cloned().chain(default_dirs()) {
        for name in lib.file_names() {
            candidates.push(dir.join(name));
        }
    }
    // Last, the bare names: the dynamic loader's own search (ld.so.cache, RPATH).
    candidates.extend(lib.file_names().iter().map(PathBuf::from));
    if let Some(driver) = driver {
        candidates = prefer_for_driver(candidates, driver);
    }
    for path in candidates {
        let bare = path.parent().map_or(true, |p| p.as_os_str().is_empty());
        if !bare && !path.is_file() {
            continue;
        }
        probe.searched.push(path.display().to_string());
        // SAFETY: loading runs the library's initializers; CUDA's libraries are made to
        // be loaded this way (it is how the CUDA runtime itself finds them).
        match unsafe { Library::new(&path) } {
            Ok(library) => match version(lib, &library) {
                Ok(version) => {
                    let found = Loaded { path, version };
                    probe.loaded = Some(found.clone());
                    table.insert(lib, (found, library));
                    return probe;
                }
                Err(e) => probe.error = Some(e),
            },
            Err(e) => probe.error = Some(e.to_string()),
        }
    }
    if probe.searched.is_empty() {
        probe.searched.push("(no candidate file exists)".into());
    }
    probe.searched = summarize(dirs, lib, probe.searched);
    probe
}

/// Whether `lib` was loaded already.
fn is_loaded(lib: CudaLib) -> bool {
    let table = loaded().lock().unwrap_or_else(|p| p.into_inner());
    table.contains_key(&lib)
}

/// The major number of a version ("12" of "12.4").
fn major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

/// The major version a library's file name carries (13 for `libnvrtc.so.13`), if any.
fn file_major(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let (_, after) = name.split_once(".so.")?;
    major(after)
}

/// NVRTC's candidates in the order to try them under a driver of major version
/// `driver`: first those whose file names carry a major version the driver has (12 under
/// a CUDA 12 driver, 12 and 13 under a 13 one), then those without one (`libnvrtc.so`),
/// then the newer ones. Each group keeps its order (folders, then names, so the newest
/// fitting version of a folder comes first). The newer ones are only a fallback: a CUBIN
/// of a newer CUDA than the driver may not load, and PTX from it does not.
pub fn prefer_for_driver(candidates: Vec<PathBuf>, driver: u32) -> Vec<PathBuf> {
    let mut ordered = candidates;
    ordered.sort_by_key(|p| match file_major(p) {
        Some(m) if m <= driver => 0,
        None => 1,
        Some(_) => 2,
    });
    ordered
}

/// Checks that cudarc's calls into `lib` go to the copy [`probe`] loaded: cudarc
/// binds by a list of names of its own, the unversioned `libcuda.so` first, and on some
/// systems the loader finds that elsewhere (a CUDA toolkit's stub driver). Only the
/// driver is called through cudarc; NVRTC and NCCL are called through Perseus's own
/// handles to the files it chose (`crate::gpu::nvrtc`, `crate::gpu::nccl`). `theirs` is
/// cudarc's handle (its `culib()`, which panics where it finds no copy at all: call this
/// under `catch_unwind`). An error names both files; nothing to check when `lib` was not
/// probed.
pub fn check_bound(lib: CudaLib, theirs: &Library) -> std::result::Result<(), String> {
    let table = loaded().lock().unwrap_or_else(|p| p.into_inner());
    let Some((found, library)) = table.get(&lib) else {
        return Ok(());
    };
    // Two functions, so that a shim defining some functions itself and passing the
    // rest to the real library is told apart from it.
    let address = |l: &Library, symbol: &[u8]| {
        // SAFETY: the symbol is only looked up, never called, here.
        unsafe { l.get::<*mut c_void>(symbol) }
            .map(|s| *s as *const c_void)
            .map_err(|e| format!("{}: {e}", lib.label()))
    };
    let mut other = None;
    for symbol in [lib.version_symbol(), lib.working_symbol()] {
        let (a, b) = (address(library, symbol)?, address(theirs, symbol)?);
        if a != b {
            other = Some(b);
            break;
        }
    }
    let Some(theirs) = other else {
        return Ok(());
    };
    let other = file_of(theirs).unwrap_or_else(|| "another file".into());
    Err(format!(
        "{} is loaded twice: Perseus chose {} ({}), but its CUDA bindings (cudarc, which \
         tries the unversioned {} first) bound {other}. Take that file off the loader's \
         path (LD_LIBRARY_PATH, ldconfig) so that both use the same one",
        lib.label(),
        found.path.display(),
        found.version,
        lib.file_names().last().copied().unwrap_or_default(),
    ))
}

/// Which of the functions `names` the loaded `lib` lacks (all of them when it was not
/// loaded). cudarc resolves each function on its first call and panics where one is
/// missing; asking first turns that into an error before any call.
pub fn lacking(lib: CudaLib, names: &[&str]) -> Vec<String> {
    let table = loaded().lock().unwrap_or_else(|p| p.into_inner());
    match table.get(&lib) {
        Some((_, library)) => lacking_in(library, names),
        None => names.iter().map(|n| n.to_string()).collect(),
    }
}

fn lacking_in(library: &Library, names: &[&str]) -> Vec<String> {
    names
        .iter()
        .filter(|n| {
            let symbol: Vec<u8> = n.bytes().chain(std::iter::once(0)).collect();
            // SAFETY: only looked up, never called.
            unsafe { library.get::<*mut c_void>(symbol.as_slice()) }.is_err()
        })
        .map(|n| n.to_string())
        .collect()
}

/// The file a loaded function lives in, as the dynamic loader says.
fn file_of(addr: *const c_void) -> Option<String> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only fills `info`; the name it points to belongs to the loader.
    let found = unsafe { libc::dladdr(addr, &mut info) } != 0 && !info.dli_fname.is_null();
    // SAFETY: as above, a NUL-terminated string while the library stays loaded.
    found.then(|| {
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The searched list as directories plus the bare names, readable in one line.
fn summarize(dirs: &[PathBuf], lib: CudaLib, tried: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = dirs
        .iter()
        .cloned()
        .chain(default_dirs())
        .map(|d| d.display().to_string())
        .collect();
    out.push(format!(
        "the dynamic loader's path for {}",
        lib.file_names().join(", ")
    ));
    for t in tried {
        if !out.iter().any(|o| t.starts_with(o.as_str())) && !t.starts_with("lib") {
            out.push(t);
        }
    }
    out
}

/// Asks a loaded library its version (the call needs no GPU).
fn version(lib: CudaLib, library: &Library) -> Result<String, String> {
    // SAFETY: each symbol is looked up with the signature CUDA documents for it, and
    // each call only writes the integers it is given.
    unsafe {
        match lib {
            CudaLib::Driver => {
                let f: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> = library
                    .get(b"cuDriverGetVersion\0")
                    .map_err(|e| e.to_string())?;
                let mut v: c_int = 0;
                match f(&mut v) {
                    0 => Ok(format!("{}.{}", v / 1000, (v % 1000) / 10)),
                    code => Err(format!("cuDriverGetVersion failed with CUDA error {code}")),
                }
            }
            CudaLib::Nvrtc => {
                let f: libloading::Symbol<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int> =
                    library.get(b"nvrtcVersion\0").map_err(|e| e.to_string())?;
                let (mut major, mut minor): (c_int, c_int) = (0, 0);
                match f(&mut major, &mut minor) {
                    0 => Ok(format!("{major}.{minor}")),
                    code => Err(format!("nvrtcVersion failed with NVRTC error {code}")),
                }
            }
            CudaLib::Nccl => {
                let f: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> = library
                    .get(b"ncclGetVersion\0")
                    .map_err(|e| e.to_string())?;
                let mut v: c_int = 0;
                match f(&mut v) {
                    0 => Ok(nccl_version(v)),
                    code => Err(format!("ncclGetVersion failed with NCCL error {code}")),
                }
            }
        }
    }
}

/// NCCL's version code as text: 2.18 and later code `major*10000 + minor*100 + patch`,
/// earlier releases `major*1000 + minor*100 + patch`.
pub fn nccl_version(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_version_codes_of_both_eras() {
        assert_eq!(nccl_version(22807), "2.28.7");
        assert_eq!(nccl_version(2708), "2.7.8");
    }

    #[test]
    fn a_missing_library_names_what_was_searched() {
        let dir = std::env::temp_dir().join("perseus-no-cuda-here");
        let p = probe(CudaLib::Nccl, std::slice::from_ref(&dir));
        if p.loaded.is_none() {
            let msg = p.missing_message();
            assert!(
                msg.contains("NCCL (libnccl.so.2 or libnccl.so) was not found"),
                "{msg}"
            );
            assert!(msg.contains("perseus-no-cuda-here"), "{msg}");
        }
    }

    #[test]
    fn the_functions_a_library_lacks_are_named() {
        // SAFETY: the C library is loaded already; nothing is called.
        let libc = unsafe { Library::new("libc.so.6") }.expect("the C library");
        assert_eq!(
            lacking_in(&libc, &["malloc", "no_such_function_here", "free"]),
            vec!["no_such_function_here".to_string()]
        );
    }

    #[test]
    fn nvrtc_suits_the_driver_and_falls_back_to_the_other() {
        let paths = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        // torch's CUDA 13 wheel first on sys.path, CUDA 12's after it, then the loader.
        let found = paths(&[
            "/w/nvidia/cu13/lib/libnvrtc.so.13",
            "/w/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
            "/usr/local/cuda/lib64/libnvrtc.so.13",
            "/usr/local/cuda/lib64/libnvrtc.so.12",
            "/usr/local/cuda/lib64/libnvrtc.so",
            "libnvrtc.so.13",
            "libnvrtc.so.12",
            "libnvrtc.so",
        ]);
        // A CUDA 12 driver: every NVRTC 12 first, in the search order; then the
        // unversioned names; NVRTC 13 only where nothing else is found.
        assert_eq!(
            prefer_for_driver(found.clone(), 12),
            paths(&[
                "/w/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
                "/usr/local/cuda/lib64/libnvrtc.so.12",
                "libnvrtc.so.12",
                "/usr/local/cuda/lib64/libnvrtc.so",
                "libnvrtc.so",
                "/w/nvidia/cu13/lib/libnvrtc.so.13",
                "/usr/local/cuda/lib64/libnvrtc.so.13",
                "libnvrtc.so.13",
            ])
        );
        // A CUDA 13 driver runs both: the search order stands, 13 before 12 per folder.
        assert_eq!(
            prefer_for_driver(found.clone(), 13),
            paths(&[
                "/w/nvidia/cu13/lib/libnvrtc.so.13",
                "/w/nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
                "/usr/local/cuda/lib64/libnvrtc.so.13",
                "/usr/local/cuda/lib64/libnvrtc.so.12",
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "/usr/local/cuda/lib64/libnvrtc.so",
                "libnvrtc.so",
            ])
        );
        assert_eq!(file_major(Path::new("/a/libnvrtc.so.12")), Some(12));
        assert_eq!(file_major(Path::new("/a/libnvrtc.so")), None);
        assert_eq!(major("12.4"), Some(12));
        assert_eq!(major("unknown"), None);
    }

    #[test]
    fn the_real_file_names_come_first() {
        assert_eq!(CudaLib::Nccl.file_names()[0], "libnccl.so.2");
        assert_eq!(CudaLib::Nvrtc.file_names()[0], "libnvrtc.so.13");
        assert_eq!(CudaLib::Driver.file_names()[0], "libcuda.so.1");
    }
}
