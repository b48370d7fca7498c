// -----// IR Dump After partition //----- //
module {
  mesh.mesh @mesh0(shape = 2x2)
  func.func @gpt2_block(%arg0: tensor<2x8xi64>, %arg1: tensor<2x8x64xf32>, %arg2: tensor<2x1x8x8xf32>, %arg3: tensor<64xf32>, %arg4: tensor<64xf32>, %arg5: tensor<64x96xf32>, %arg6: tensor<96xf32>, %arg7: tensor<32x64xf32>, %arg8: tensor<64xf32>, %arg9: tensor<64xf32>, %arg10: tensor<64xf32>, %arg11: tensor<64x128xf32>, %arg12: tensor<128xf32>, %arg13: tensor<128x64xf32>, %arg14: tensor<64xf32>, %arg15: tensor<2xi64>, %arg16: tensor<2xi64>, %arg17: tensor<1xi64>, %arg18: tensor<f32>, %arg19: tensor<1xi64>, %arg20: tensor<1xi64>, %arg21: tensor<f32>, %arg22: tensor<1xi64>, %arg23: tensor<1xi64>, %arg24: tensor<f32>, %arg25: tensor<f32>, %arg26: tensor<f32>, %arg27: tensor<f32>) -> tensor<2x8x32xf32> {
    %sharding = mesh.sharding @mesh0 split_axes = [[0]] : !mesh.sharding
    %sharding_1 = mesh.sharding @mesh0 split_axes = [[]] : !mesh.sharding
    %sharding_2 = mesh.sharding @mesh0 split_axes = [[], [1]] : !mesh.sharding
    %sharding_3 = mesh.sharding @mesh0 split_axes = [[1]] : !mesh.sharding
    %sharding_4 = mesh.sharding @mesh0 split_axes = [[0], [1]] : !mesh.sharding
    %sharding_5 = mesh.sharding @mesh0 split_axes = [[0], [], [1]] : !mesh.sharding
    %sharding_6 = mesh.sharding @mesh0 split_axes = [[0]] partial = sum[1] : !mesh.sharding
    %input_ids = mesh.shard %arg0 to %sharding : tensor<2x8xi64> loc("input_ids")
    %add_20 = mesh.shard %arg1 to %sharding : tensor<2x8x64xf32> loc("add_20")
    %where = mesh.shard %arg2 to %sharding : tensor<2x1x8x8xf32> loc("where")
    %lm.transformer.h.0.ln_1.weight = mesh.shard %arg3 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.ln_1.weight")
    %lm.transformer.h.0.ln_1.bias = mesh.shard %arg4 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.ln_1.bias")
    %lm.transformer.h.0.attn.c_attn.weight = mesh.shard %arg5 to %sharding_2 : tensor<64x96xf32> loc("lm.transformer.h.0.attn.c_attn.weight")
    %lm.transformer.h.0.attn.c_attn.bias = mesh.shard %arg6 to %sharding_3 : tensor<96xf32> loc("lm.transformer.h.0.attn.c_attn.bias")
    %lm.transformer.h.0.attn.c_proj.weight = mesh.shard %arg7 to %sharding_3 : tensor<32x64xf32> loc("lm.transformer.h.0.attn.c_proj.weight")
    %lm.transformer.h.0.attn.c_proj.bias = mesh.shard %arg8 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.attn.c_proj.bias")
    %lm.transformer.h.0.ln_2.weight = mesh.shard %arg9 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.ln_2.weight")
    %lm.transformer.h.0.ln_2.bias = mesh.shard %arg10 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.ln_2.bias")
    %lm.transformer.h.0.mlp.c_fc.weight = mesh.shard %arg11 to %sharding_2 : tensor<64x128xf32> loc("lm.transformer.h.0.mlp.c_fc.weight")
    %lm.transformer.h.0.mlp.c_fc.bias = mesh.shard %arg12 to %sharding_3 : tensor<128xf32> loc("lm.transformer.h.0.mlp.c_fc.bias")
    %lm.transformer.h.0.mlp.c_proj.weight = mesh.shard %arg13 to %sharding_3 : tensor<128x64xf32> loc("lm.transformer.h.0.mlp.c_proj.weight")
    %lm.transformer.h.0.mlp.c_proj.bias = mesh.shard %arg14 to %sharding_1 : tensor<64xf32> loc("lm.transformer.h.0.mlp.c_proj.bias")
    %val_55 = mesh.shard %arg15 to %sharding_1 : tensor<2xi64> loc("val_55")
    %val_114 = mesh.shard %arg16 to %sharding_1 : tensor<2xi64> loc("val_114")
    %val_6 = mesh.shard %arg17 to %sharding_1 : tensor<1xi64> loc("val_6")
    %val_11 = mesh.shard %arg18 to %sharding_1 : tensor<f32> loc("val_11")
    %val_59 = mesh.shard %arg19 to %sharding_1 : tensor<1xi64> loc("val_59")
    %val_67 = mesh.shard %arg20 to %sharding_1 : tensor<1xi64> loc("val_67")
    %val_81 = mesh.shard %arg21 to %sharding_1 : tensor<f32> loc("val_81")
    %val_94 = mesh.shard %arg22 to %sharding_1 : tensor<1xi64> loc("val_94")
    %val_105 = mesh.shard %arg23 to %sharding_1 : tensor<1xi64> loc("val_105")
    %val_107 = mesh.shard %arg24 to %sharding_1 : tensor<f32> loc("val_107")
    %val_108 = mesh.shard %arg25 to %sharding_1 : tensor<f32> loc("val_108")
    %val_109 = mesh.shard %arg26 to %sharding_1 : tensor<f32> loc("val_109")
    %val_110 = mesh.shard %arg27 to %sharding_1 : tensor<f32> loc("val_110")
    %1 = "onnx.Constant"() {value = dense<4> : tensor<1xi64>} : () -> tensor<1xi64>
    %val_0 = mesh.shard %1 to %sharding_1 : tensor<1xi64> loc("val_0")
    %2 = "onnx.Constant"() {value = dense<8> : tensor<1xi64>} : () -> tensor<1xi64>
    %val_1 = mesh.shard %2 to %sharding_1 : tensor<1xi64> loc("val_1")
    %3 = "onnx.Constant"() {value = dense<[2, 8, 96]> : tensor<3xi64>} : () -> tensor<3xi64>
    %val_60 = mesh.shard %3 to %sharding_1 : tensor<3xi64> loc("val_60")
    %4 = "onnx.Constant"() {value = dense<[4, 8, -1, 16]> : tensor<4xi64>} : () -> tensor<4xi64>
    %val_68 = mesh.shard %4 to %sharding_1 : tensor<4xi64> loc("val_68")
    %5 = "onnx.Constant"() {value = dense<[4, 8, 64]> : tensor<3xi64>} : () -> tensor<3xi64>
    %val_95 = mesh.shard %5 to %sharding_1 : tensor<3xi64> loc("val_95")
    %6 = "onnx.Constant"() {value = dense<[2, 8, 128]> : tensor<3xi64>} : () -> tensor<3xi64>
    %val_106 = mesh.shard %6 to %sharding_1 : tensor<3xi64> loc("val_106")
    %7 = "onnx.Constant"() {value = dense<[16, 64]> : tensor<2xi64>} : () -> tensor<2xi64>
    %node_view_2.shape = mesh.shard %7 to %sharding_1 : tensor<2xi64> loc("node_view_2.shape")
    %8 = "onnx.Constant"() {value = dense<[2, 8, 2, 16]> : tensor<4xi64>} : () -> tensor<4xi64>
    %node_view_4.shape = mesh.shard %8 to %sharding_1 : tensor<4xi64> loc("node_view_4.shape")
    %9 = "onnx.Constant"() {value = dense<[2, 8, 2, 16]> : tensor<4xi64>} : () -> tensor<4xi64>
    %node_view_5.shape = mesh.shard %9 to %sharding_1 : tensor<4xi64> loc("node_view_5.shape")
    %10 = "onnx.Constant"() {value = dense<[2, 8, 2, 16]> : tensor<4xi64>} : () -> tensor<4xi64>
    %node_view_6.shape = mesh.shard %10 to %sharding_1 : tensor<4xi64> loc("node_view_6.shape")
    %11 = "onnx.Constant"() {value = dense<[16, 32]> : tensor<2xi64>} : () -> tensor<2xi64>
    %node_Reshape_231.shape = mesh.shard %11 to %sharding_1 : tensor<2xi64> loc("node_Reshape_231.shape")
    %12 = "onnx.Constant"() {value = dense<[2, 8, 32]> : tensor<3xi64>} : () -> tensor<3xi64>
    %node_view_8.shape = mesh.shard %12 to %sharding_1 : tensor<3xi64> loc("node_view_8.shape")
    %13 = "onnx.Constant"() {value = dense<[16, 64]> : tensor<2xi64>} : () -> tensor<2xi64>
    %node_view_9.shape = mesh.shard %13 to %sharding_1 : tensor<2xi64> loc("node_view_9.shape")
    %14 = "onnx.Constant"() {value = dense<[16, 128]> : tensor<2xi64>} : () -> tensor<2xi64>
    %node_view_11.shape = mesh.shard %14 to %sharding_1 : tensor<2xi64> loc("node_view_11.shape")
    %15 = "onnx.Constant"() {value = dense<[2, 8, 32]> : tensor<3xi64>} : () -> tensor<3xi64>
    %node_view_12.shape = mesh.shard %15 to %sharding_1 : tensor<3xi64> loc("node_view_12.shape")
    %16 = "onnx.LayerNormalization"(%add_20, %lm.transformer.h.0.ln_1.weight, %lm.transformer.h.0.ln_1.bias) {axis = -1 : i64, epsilon = 1.0e-05 : f32, sharding = "[[0], [], []]", stash_type = 1 : i64} : (tensor<2x8x64xf32>, tensor<64xf32>, tensor<64xf32>) -> tensor<2x8x64xf32> loc("node_layer_norm")
    %layer_norm = mesh.shard %16 to %sharding : tensor<2x8x64xf32> loc("layer_norm")
    %17 = "onnx.Reshape"(%layer_norm, %node_view_2.shape) {allowzero = 1 : i64, sharding = "[[0], []]"} : (tensor<2x8x64xf32>, tensor<2xi64>) -> tensor<16x64xf32> loc("node_view_2")
    %view_2 = mesh.shard %17 to %sharding : tensor<16x64xf32> loc("view_2")
    %18 = "onnx.Gemm"(%view_2, %lm.transformer.h.0.attn.c_attn.weight, %lm.transformer.h.0.attn.c_attn.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [1], []]", transA = 0 : i64, transB = 0 : i64} : (tensor<16x64xf32>, tensor<64x96xf32>, tensor<96xf32>) -> tensor<16x96xf32> loc("node_addmm")
    %addmm = mesh.shard %18 to %sharding_4 : tensor<16x96xf32> loc("addmm")
    %19 = "onnx.Reshape"(%addmm, %val_60) {allowzero = 1 : i64, sharding = "[[0], [1]]"} : (tensor<16x96xf32>, tensor<3xi64>) -> tensor<2x8x96xf32> loc("node_view_3")
    %view_3 = mesh.shard %19 to %sharding_5 : tensor<2x8x96xf32> loc("view_3")
    %20 = mesh.all_gather %view_3 on @mesh0 mesh_axes = [1] gather_axis = 2 : tensor<2x8x96xf32> -> tensor<2x8x192xf32>
    %view_3_1 = mesh.shard %20 to %sharding : tensor<2x8x192xf32> loc("view_3~1"("view_3"))
    %21:3 = "onnx.Split"(%view_3_1) {axis = 2 : i64, num_outputs = 3 : i64, sharding = "[[0], [], []]"} : (tensor<2x8x192xf32>) -> (tensor<2x8x64xf32>, tensor<2x8x64xf32>, tensor<2x8x64xf32>) loc("node_Split_194")
    %split_split_0 = mesh.shard %21#0 to %sharding : tensor<2x8x64xf32> loc("split_split_0")
    %split_split_1 = mesh.shard %21#1 to %sharding : tensor<2x8x64xf32> loc("split_split_1")
    %split_split_2 = mesh.shard %21#2 to %sharding : tensor<2x8x64xf32> loc("split_split_2")
    %22 = mesh.all_slice %split_split_1 on @mesh0 mesh_axes = [1] slice_axis = 2 : tensor<2x8x64xf32> -> tensor<2x8x32xf32>
    %split_split_1_1 = mesh.shard %22 to %sharding_5 : tensor<2x8x32xf32> loc("split_split_1~1"("split_split_1"))
    %23 = "onnx.Reshape"(%split_split_1_1, %node_view_4.shape) {allowzero = 1 : i64, sharding = "[[0], [], [1]]"} : (tensor<2x8x32xf32>, tensor<4xi64>) -> tensor<2x8x2x16xf32> loc("node_view_4")
    %view_4 = mesh.shard %23 to %sharding_5 : tensor<2x8x2x16xf32> loc("view_4")
    %24 = mesh.all_slice %split_split_2 on @mesh0 mesh_axes = [1] slice_axis = 2 : tensor<2x8x64xf32> -> tensor<2x8x32xf32>
    %split_split_2_1 = mesh.shard %24 to %sharding_5 : tensor<2x8x32xf32> loc("split_split_2~1"("split_split_2"))
    %25 = "onnx.Reshape"(%split_split_2_1, %node_view_5.shape) {allowzero = 1 : i64, sharding = "[[0], [], [1]]"} : (tensor<2x8x32xf32>, tensor<4xi64>) -> tensor<2x8x2x16xf32> loc("node_view_5")
    %view_5 = mesh.shard %25 to %sharding_5 : tensor<2x8x2x16xf32> loc("view_5")
    %26 = "onnx.Transpose"(%view_5) {perm = [0, 2, 1, 3], sharding = "[[0], [1], [], []]"} : (tensor<2x8x2x16xf32>) -> tensor<2x2x8x16xf32> loc("node_transpose_1")
    %transpose_1 = mesh.shard %26 to %sharding_4 : tensor<2x2x8x16xf32> loc("transpose_1")
    %27 = mesh.all_slice %split_split_0 on @mesh0 mesh_axes = [1] slice_axis = 2 : tensor<2x8x64xf32> -> tensor<2x8x32xf32>
    %split_split_0_1 = mesh.shard %27 to %sharding_5 : tensor<2x8x32xf32> loc("split_split_0~1"("split_split_0"))
    %28 = "onnx.Reshape"(%split_split_0_1, %node_view_6.shape) {allowzero = 1 : i64, sharding = "[[0], [], [1]]"} : (tensor<2x8x32xf32>, tensor<4xi64>) -> tensor<2x8x2x16xf32> loc("node_view_6")
    %view_6 = mesh.shard %28 to %sharding_5 : tensor<2x8x2x16xf32> loc("view_6")
    %29 = "onnx.Transpose"(%view_6) {perm = [0, 2, 1, 3], sharding = "[[0], [1], [], []]"} : (tensor<2x8x2x16xf32>) -> tensor<2x2x8x16xf32> loc("node_transpose_2")
    %transpose_2 = mesh.shard %29 to %sharding_4 : tensor<2x2x8x16xf32> loc("transpose_2")
    %30 = "onnx.Transpose"(%view_4) {perm = [0, 2, 3, 1], sharding = "[[0], [1], [], []]"} : (tensor<2x8x2x16xf32>) -> tensor<2x2x16x8xf32> loc("node_Transpose_228")
    %transpose_3 = mesh.shard %30 to %sharding_4 : tensor<2x2x16x8xf32> loc("transpose_3")
    %31 = "onnx.MatMul"(%transpose_2, %transpose_3) {sharding = "[[0], [1], [], [], []]"} : (tensor<2x2x8x16xf32>, tensor<2x2x16x8xf32>) -> tensor<2x2x8x8xf32> loc("node_matmul")
    %matmul = mesh.shard %31 to %sharding_4 : tensor<2x2x8x8xf32> loc("matmul")
    %32 = "onnx.Mul"(%matmul, %val_81) {sharding = "[[0], [1], [], []]"} : (tensor<2x2x8x8xf32>, tensor<f32>) -> tensor<2x2x8x8xf32> loc("node_mul_111")
    %mul_111 = mesh.shard %32 to %sharding_4 : tensor<2x2x8x8xf32> loc("mul_111")
    %33 = "onnx.Add"(%mul_111, %where) {sharding = "[[0], [1], [], []]"} : (tensor<2x2x8x8xf32>, tensor<2x1x8x8xf32>) -> tensor<2x2x8x8xf32> loc("node_add_169")
    %add_169 = mesh.shard %33 to %sharding_4 : tensor<2x2x8x8xf32> loc("add_169")
    %34 = "onnx.Softmax"(%add_169) {axis = -1 : i64, sharding = "[[0], [1], [], []]"} : (tensor<2x2x8x8xf32>) -> tensor<2x2x8x8xf32> loc("node_softmax")
    %softmax = mesh.shard %34 to %sharding_4 : tensor<2x2x8x8xf32> loc("softmax")
    %35 = "onnx.MatMul"(%softmax, %transpose_1) {sharding = "[[0], [1], [], [], []]"} : (tensor<2x2x8x8xf32>, tensor<2x2x8x16xf32>) -> tensor<2x2x8x16xf32> loc("node_matmul_1")
    %matmul_1 = mesh.shard %35 to %sharding_4 : tensor<2x2x8x16xf32> loc("matmul_1")
    %36 = "onnx.Transpose"(%matmul_1) {perm = [0, 2, 1, 3], sharding = "[[0], [], [1], []]"} : (tensor<2x2x8x16xf32>) -> tensor<2x8x2x16xf32> loc("node_transpose_4")
    %transpose_4 = mesh.shard %36 to %sharding_5 : tensor<2x8x2x16xf32> loc("transpose_4")
    %37 = "onnx.Reshape"(%transpose_4, %node_Reshape_231.shape) {sharding = "[[0], [1]]"} : (tensor<2x8x2x16xf32>, tensor<2xi64>) -> tensor<16x32xf32> loc("node_Reshape_231")
    %view_7 = mesh.shard %37 to %sharding_4 : tensor<16x32xf32> loc("view_7")
    %38 = "onnx.Gemm"(%view_7, %lm.transformer.h.0.attn.c_proj.weight, %lm.transformer.h.0.attn.c_proj.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [], [1]]", transA = 0 : i64, transB = 0 : i64} : (tensor<16x32xf32>, tensor<32x64xf32>, tensor<64xf32>) -> tensor<16x64xf32> loc("node_addmm_1")
    %addmm_1 = mesh.shard %38 to %sharding_6 : tensor<16x64xf32> loc("addmm_1")
    %39 = mesh.reduce_scatter %addmm_1 on @mesh0 mesh_axes = [1] reduction = <sum> scatter_axis = 1 : tensor<16x64xf32> -> tensor<16x32xf32>
    %addmm_1_1 = mesh.shard %39 to %sharding_4 : tensor<16x32xf32> loc("addmm_1~1"("addmm_1"))
    %40 = "onnx.Reshape"(%addmm_1_1, %node_view_8.shape) {allowzero = 1 : i64, sharding = "[[0], [1]]"} : (tensor<16x32xf32>, tensor<3xi64>) -> tensor<2x8x32xf32> loc("node_view_8")
    %view_8 = mesh.shard %40 to %sharding_5 : tensor<2x8x32xf32> loc("view_8")
    %41 = mesh.all_slice %add_20 on @mesh0 mesh_axes = [1] slice_axis = 2 : tensor<2x8x64xf32> -> tensor<2x8x32xf32>
    %add_20_c1 = mesh.shard %41 to %sharding_5 : tensor<2x8x32xf32> loc("add_20~c1"("add_20"))
    %42 = "onnx.Add"(%view_8, %add_20_c1) {sharding = "[[0], [], [1]]"} : (tensor<2x8x32xf32>, tensor<2x8x32xf32>) -> tensor<2x8x32xf32> loc("node_add_218")
    %add_218_c2 = mesh.shard %42 to %sharding_5 : tensor<2x8x32xf32> loc("add_218~c2"("add_218"))
    %43 = mesh.all_gather %add_218_c2 on @mesh0 mesh_axes = [1] gather_axis = 2 : tensor<2x8x32xf32> -> tensor<2x8x64xf32>
    %add_218 = mesh.shard %43 to %sharding : tensor<2x8x64xf32> loc("add_218")
    %44 = "onnx.LayerNormalization"(%add_218, %lm.transformer.h.0.ln_2.weight, %lm.transformer.h.0.ln_2.bias) {axis = -1 : i64, epsilon = 1.0e-05 : f32, sharding = "[[0], [], []]", stash_type = 1 : i64} : (tensor<2x8x64xf32>, tensor<64xf32>, tensor<64xf32>) -> tensor<2x8x64xf32> loc("node_layer_norm_1")
    %layer_norm_1 = mesh.shard %44 to %sharding : tensor<2x8x64xf32> loc("layer_norm_1")
    %45 = "onnx.Reshape"(%layer_norm_1, %node_view_9.shape) {allowzero = 1 : i64, sharding = "[[0], []]"} : (tensor<2x8x64xf32>, tensor<2xi64>) -> tensor<16x64xf32> loc("node_view_9")
    %view_9 = mesh.shard %45 to %sharding : tensor<16x64xf32> loc("view_9")
    %46 = "onnx.Gemm"(%view_9, %lm.transformer.h.0.mlp.c_fc.weight, %lm.transformer.h.0.mlp.c_fc.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [1], []]", transA = 0 : i64, transB = 0 : i64} : (tensor<16x64xf32>, tensor<64x128xf32>, tensor<128xf32>) -> tensor<16x128xf32> loc("node_addmm_2")
    %addmm_2 = mesh.shard %46 to %sharding_4 : tensor<16x128xf32> loc("addmm_2")
    %47 = "onnx.Reshape"(%addmm_2, %val_106) {allowzero = 1 : i64, sharding = "[[0], [1]]"} : (tensor<16x128xf32>, tensor<3xi64>) -> tensor<2x8x128xf32> loc("node_view_10")
    %view_10 = mesh.shard %47 to %sharding_5 : tensor<2x8x128xf32> loc("view_10")
    %48 = "onnx.Mul"(%view_10, %val_107) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<f32>) -> tensor<2x8x128xf32> loc("node_mul_186")
    %mul_186 = mesh.shard %48 to %sharding_5 : tensor<2x8x128xf32> loc("mul_186")
    %49 = "onnx.Pow"(%view_10, %val_108) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<f32>) -> tensor<2x8x128xf32> loc("node_pow_1")
    %pow_1 = mesh.shard %49 to %sharding_5 : tensor<2x8x128xf32> loc("pow_1")
    %50 = "onnx.Mul"(%pow_1, %val_109) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<f32>) -> tensor<2x8x128xf32> loc("node_mul_193")
    %mul_193 = mesh.shard %50 to %sharding_5 : tensor<2x8x128xf32> loc("mul_193")
    %51 = "onnx.Add"(%view_10, %mul_193) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<2x8x128xf32>) -> tensor<2x8x128xf32> loc("node_add_249")
    %add_249 = mesh.shard %51 to %sharding_5 : tensor<2x8x128xf32> loc("add_249")
    %52 = "onnx.Mul"(%add_249, %val_110) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<f32>) -> tensor<2x8x128xf32> loc("node_mul_200")
    %mul_200 = mesh.shard %52 to %sharding_5 : tensor<2x8x128xf32> loc("mul_200")
    %53 = "onnx.Tanh"(%mul_200) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>) -> tensor<2x8x128xf32> loc("node_tanh")
    %tanh = mesh.shard %53 to %sharding_5 : tensor<2x8x128xf32> loc("tanh")
    %54 = "onnx.Add"(%tanh, %val_11) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<f32>) -> tensor<2x8x128xf32> loc("node_add_262")
    %add_262 = mesh.shard %54 to %sharding_5 : tensor<2x8x128xf32> loc("add_262")
    %55 = "onnx.Mul"(%mul_186, %add_262) {sharding = "[[0], [], [1]]"} : (tensor<2x8x128xf32>, tensor<2x8x128xf32>) -> tensor<2x8x128xf32> loc("node_mul_210")
    %mul_210 = mesh.shard %55 to %sharding_5 : tensor<2x8x128xf32> loc("mul_210")
    %56 = "onnx.Reshape"(%mul_210, %node_view_11.shape) {allowzero = 1 : i64, sharding = "[[0], [1]]"} : (tensor<2x8x128xf32>, tensor<2xi64>) -> tensor<16x128xf32> loc("node_view_11")
    %view_11 = mesh.shard %56 to %sharding_4 : tensor<16x128xf32> loc("view_11")
    %57 = "onnx.Gemm"(%view_11, %lm.transformer.h.0.mlp.c_proj.weight, %lm.transformer.h.0.mlp.c_proj.bias) {alpha = 1.0 : f32, beta = 1.0 : f32, sharding = "[[0], [], [1]]", transA = 0 : i64, transB = 0 : i64} : (tensor<16x128xf32>, tensor<128x64xf32>, tensor<64xf32>) -> tensor<16x64xf32> loc("node_addmm_3")
    %addmm_3 = mesh.shard %57 to %sharding_6 : tensor<16x64xf32> loc("addmm_3")
    %58 = mesh.reduce_scatter %addmm_3 on @mesh0 mesh_axes = [1] reduction = <sum> scatter_axis = 1 : tensor<16x64xf32> -> tensor<16x32xf32>
    %addmm_3_1 = mesh.shard %58 to %sharding_4 : tensor<16x32xf32> loc("addmm_3~1"("addmm_3"))
    %59 = "onnx.Reshape"(%addmm_3_1, %node_view_12.shape) {allowzero = 1 : i64, sharding = "[[0], [1]]"} : (tensor<16x32xf32>, tensor<3xi64>) -> tensor<2x8x32xf32> loc("node_view_12")
    %view_12 = mesh.shard %59 to %sharding_5 : tensor<2x8x32xf32> loc("view_12")
    %60 = mesh.all_slice %add_218 on @mesh0 mesh_axes = [1] slice_axis = 2 : tensor<2x8x64xf32> -> tensor<2x8x32xf32>
    %add_218_1 = mesh.shard %60 to %sharding_5 : tensor<2x8x32xf32> loc("add_218~1"("add_218"))
    %61 = "onnx.Add"(%add_218_1, %view_12) {sharding = "[[0], [], [1]]"} : (tensor<2x8x32xf32>, tensor<2x8x32xf32>) -> tensor<2x8x32xf32> loc("node_add_285")
    %add_285 = mesh.shard %61 to %sharding_5 : tensor<2x8x32xf32> loc("add_285")
    return %add_285 : tensor<2x8x32xf32>
  }
}
