"""Names CuPy 14 shares with NumPy (read off `dir(cupy)` and `dir(cupy.ndarray)` of
cupy-cuda12x 14.2.0), so the emulated module offers exactly these."""

#: cupy.X that are ufuncs
UFUNCS = frozenset("""
    abs absolute acos acosh add arccos arccosh arcsin arcsinh arctan arctan2 arctanh asin
    asinh atan atan2 atanh bitwise_and bitwise_count bitwise_invert bitwise_left_shift
    bitwise_not bitwise_or bitwise_right_shift bitwise_xor cbrt ceil conj conjugate copysign
    cos cosh deg2rad degrees divide divmod equal exp exp2 expm1 fabs fix float_power floor
    floor_divide fmax fmin fmod frexp gcd greater greater_equal heaviside hypot i0 invert
    isfinite isinf isnan lcm ldexp left_shift less less_equal log log10 log1p log2 logaddexp
    logaddexp2 logical_and logical_not logical_or logical_xor maximum minimum mod modf
    multiply negative nextafter not_equal positive pow power rad2deg radians reciprocal
    remainder right_shift rint sign signbit sin sinc sinh sqrt square subtract tan tanh
    true_divide trunc
""".split())

#: other cupy.X functions with a NumPy namesake
FUNCTIONS = frozenset("""
    all allclose amax amin angle any append apply_along_axis apply_over_axes arange argmax
    argmin argpartition argsort argwhere around array array2string array_equal array_equiv
    array_repr array_split array_str asanyarray asarray asarray_chkfinite ascontiguousarray
    asfortranarray astype atleast_1d atleast_2d atleast_3d average bartlett base_repr
    binary_repr bincount blackman broadcast_arrays broadcast_shapes broadcast_to can_cast
    choose clip column_stack common_type compress concat concatenate convolve copy copyto
    corrcoef correlate count_nonzero cov cross cumprod cumsum cumulative_prod cumulative_sum
    delete diag diag_indices diag_indices_from diagflat diagonal diff digitize dot dsplit
    dstack ediff1d einsum empty empty_like expand_dims extract eye fill_diagonal flatnonzero
    flip fliplr flipud format_float_positional format_float_scientific from_dlpack
    frombuffer fromfile fromfunction fromiter fromstring full full_like genfromtxt
    get_printoptions gradient hamming hanning histogram histogram2d histogramdd hsplit
    hstack identity imag indices inner interp intersect1d isclose iscomplex iscomplexobj
    isdtype isfortran isin isneginf isposinf isreal isrealobj isscalar issubdtype iterable
    ix_ kaiser kron lexsort linspace load loadtxt logspace mask_indices matmul
    matrix_transpose max may_share_memory mean median meshgrid min min_scalar_type
    mintypecode moveaxis nan_to_num nanargmax nanargmin nancumprod nancumsum nanmax nanmean
    nanmedian nanmin nanprod nanstd nansum nanvar ndim nonzero ones ones_like outer packbits
    pad partition percentile permute_dims piecewise place poly polyadd polyfit polymul
    polysub polyval printoptions prod promote_types ptp put put_along_axis putmask quantile
    ravel ravel_multi_index real real_if_close repeat require reshape resize result_type
    roll rollaxis roots rot90 round row_stack save savetxt savez savez_compressed
    searchsorted select set_printoptions setdiff1d setxor1d shape shares_memory show_config
    size sort sort_complex split squeeze stack std sum swapaxes take take_along_axis
    tensordot tile trace transpose trapezoid tri tril tril_indices tril_indices_from
    trim_zeros triu triu_indices triu_indices_from typename union1d unique unique_all
    unique_counts unique_inverse unique_values unpackbits unravel_index unwrap vander var
    vdot vsplit vstack where zeros zeros_like
""".split())

#: scalar types and other classes cupy re-exports from NumPy
TYPES = frozenset("""
    bool bool_ broadcast byte cdouble complex128 complex64 complexfloating csingle double
    dtype finfo flatiter float16 float32 float64 floating generic half iinfo inexact int16
    int32 int64 int8 int_ intc integer intp long longlong ndindex number poly1d short
    signedinteger single ubyte ufunc uint uint16 uint32 uint64 uint8 uintc uintp ulong
    ulonglong unsignedinteger ushort vectorize
""".split())

#: public attributes of cupy.ndarray
METHODS = frozenset("""
    T all any argmax argmin argpartition argsort astype base byteswap choose clip compress
    conj conjugate copy cstruct cumprod cumsum data device diagonal dot dtype dump dumps
    fill flags flat flatten get imag item itemsize mT max mdspan mean min nbytes ndim
    nonzero partition prod ptp put ravel real reduced_view repeat reshape round scatter_add
    scatter_max scatter_min searchsorted set shape size sort squeeze std strides sum
    swapaxes take toDlpack tobytes tofile tolist trace transpose var view
""".split())
